"""Chat prompts as transformers makes them: our rendering and tokenizing of a model's
template against `apply_chat_template`, for four template styles, in both places a
template is kept (`tokenizer_config.json`, `chat_template.jinja`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer, processors

from ingest.chat_template import ChatTemplate, ChatTemplateError
from ingest.prompting import PromptBuilder, PromptError
from schemas import InferenceRequest
from tests.real_model import smollm2_dir

# Written in the manner of each family's published template (not copies of them).
LLAMA3_STYLE = (
    "{{- bos_token }}\n"
    "{%- set today = strftime_now('%Y') %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Year: ' + today + '\\n\\n' }}\n"
    "{{- system + '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

MISTRAL_STYLE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}"
    "{% endfor %}"
)

GEMMA_STYLE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "  Answer in one word. "},
     {"role": "user", "content": "Capital of Italy?"}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Count to three: un, deux, trois — ¿y en español?"}],
]


@pytest.fixture(scope="module")
def smol() -> Path:
    return smollm2_dir()


def _style_dir(base: Path, out: Path, *, special: list[str], config: dict,
               template_file: str | None = None, bos_on_encode: str | None = None) -> Path:
    """SmolLM2's real tokenizer with this family's special tokens and template."""
    out.mkdir()
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.add_special_tokens(special)
    if bos_on_encode is not None:  # tokenizer(text) adds the bos, as Llama 3's does
        bos_id = tok.token_to_id(bos_on_encode)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_on_encode} $A", pair=f"{bos_on_encode} $A {bos_on_encode} $B",
            special_tokens=[(bos_on_encode, bos_id)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if template_file is not None:
        (out / "chat_template.jinja").write_text(template_file)
    shutil.copy(base / "config.json", out / "config.json")
    return out


def _styles(smol: Path, tmp: Path) -> dict[str, Path]:
    return {
        "chatml": smol,
        "llama3": _style_dir(
            smol, tmp / "llama3",
            special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>"],
            config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                    "chat_template": LLAMA3_STYLE},
            bos_on_encode="<|begin_of_text|>"),
        "mistral": _style_dir(
            smol, tmp / "mistral", special=["<s>", "</s>"],
            config={"bos_token": {"__type": "AddedToken", "content": "<s>", "special": True,
                                  "lstrip": False, "rstrip": False, "normalized": False,
                                  "single_word": False},
                    "eos_token": "</s>",
                    "chat_template": [{"name": "default", "template": MISTRAL_STYLE},
                                      {"name": "tool_use", "template": "{{ 1 / 0 }}"}]}),
        "gemma": _style_dir(
            smol, tmp / "gemma", special=["<bos>", "<start_of_turn>", "<end_of_turn>"],
            config={"bos_token": "<bos>", "eos_token": "<end_of_turn>"},
            template_file=GEMMA_STYLE),
    }


def _hf_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    out = hf.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _builder(model_dir: Path) -> PromptBuilder:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return PromptBuilder.for_model(model_dir, tok, tok.get_vocab_size())


def _request(messages: list[dict]) -> InferenceRequest:
    return InferenceRequest(request_id="r", model="m", messages=messages)


def test_prompt_ids_equal_apply_chat_template(smol, tmp_path) -> None:
    from transformers import AutoTokenizer

    checked = 0
    for style, model_dir in _styles(smol, tmp_path).items():
        builder = _builder(model_dir)
        assert builder.template is not None, style
        for messages in CONVERSATIONS:
            try:
                expected = _hf_ids(model_dir, messages)
            except jinja2.TemplateError as exc:  # the template refuses these: so must we
                with pytest.raises(PromptError) as info:
                    builder.token_ids(_request(messages))
                assert str(exc) in str(info.value), (style, exc, info.value)
                continue
            assert builder.token_ids(_request(messages)) == expected, (style, messages)
            checked += 1
        # A plain prompt is what tokenizer(text) gives: no invented beginning.
        hf = AutoTokenizer.from_pretrained(str(model_dir))
        text = "The river runs to the sea."
        assert builder.text_ids(text) == hf(text)["input_ids"], style
    # every style answered at least the plain one-user conversation
    assert checked >= 9


def test_templates_that_refuse_give_their_own_message(smol, tmp_path) -> None:
    styles = _styles(smol, tmp_path)
    gemma, mistral = _builder(styles["gemma"]), _builder(styles["mistral"])
    with pytest.raises(PromptError, match="System role not supported"):
        gemma.token_ids(_request(CONVERSATIONS[1]))
    with pytest.raises(PromptError, match="Conversation roles must alternate"):
        mistral.token_ids(_request([{"role": "user", "content": "a"},
                                    {"role": "user", "content": "b"}]))


def test_template_sources_and_their_errors(tmp_path) -> None:
    assert ChatTemplate.from_dir(tmp_path) is None  # no template: the plain framing
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}]}))
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        ChatTemplate.from_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
    template = ChatTemplate.from_dir(tmp_path)  # the .jinja file wins
    assert template is not None and template.origin == "chat_template.jinja"
    with pytest.raises(ChatTemplateError, match="does not parse"):
        template.render([{"role": "user", "content": "x"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", "t")
    with pytest.raises(ChatTemplateError):
        sandboxed.render([])


# A template that renders tools, in the manner of the hermes/Qwen 2.5 family.
HERMES_TOOLS_STYLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call functions. Signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nReply with <tool_call>\\n{\"name\": ..., \"arguments\": ...}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{- call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time."}},
]


def test_tools_and_calls_render_as_apply_chat_template(smol, tmp_path) -> None:
    """A tool-aware template gets the tools, the assistant's earlier calls (arguments as
    objects) and the tool results exactly as transformers hands them over."""
    from transformers import AutoTokenizer

    model_dir = _style_dir(smol, tmp_path / "hermes", special=[],
                           config={"eos_token": "<|im_end|>",
                                   "chat_template": HERMES_TOOLS_STYLE})
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    wire = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris, and the time?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
            {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]
    # transformers' documented shape: arguments as objects
    hf_messages = [dict(m) for m in wire]
    hf_messages[2] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in calls]}
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    for messages_wire, messages_hf in ((wire[:2], hf_messages[:2]), (wire, hf_messages)):
        expected = hf.apply_chat_template(messages_hf, tools=WEATHER_TOOLS,
                                          add_generation_prompt=True)
        expected = list(expected["input_ids"] if not isinstance(expected, list) else expected)
        builder = _builder(model_dir)
        request = InferenceRequest(request_id="r", model="m", messages=messages_wire,
                                   tools=WEATHER_TOOLS)
        prompt = builder.build(request)
        assert prompt.token_ids == expected, hf.decode(expected)
        assert prompt.tool_format == "hermes"  # the template's own call format, detected
        text = hf.decode(expected)
        assert "<tools>" in text and '"get_weather"' in text  # the tools reached the template
    assert '"arguments": {"city": "Paris", "unit": "c"}' in text and "18 C, clear" in text
