"""Prompt ids beyond the template itself: plain prompts, the plain framing, the
model's stop ids and sampling defaults, and the memory that lets a conversation's
next turn find the ids this worker generated (even where a fresh tokenization of
the answer's text would differ)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gpu_runtime import ModelConfig, SamplingDefaults
from gpu_runtime.tiny import make_tiny_model
from ingest.prompting import ASSISTANT_PREFIX, PromptBuilder, frame_message
from ingest.turns import RememberedTurn, TurnMemory

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture
def chatml(tiny: Path, tmp_path: Path) -> Path:
    """The tiny model with ChatML's turn tokens and template."""
    out = tmp_path / "chatml"
    out.mkdir()
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHATML)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (out / "config.json").write_text((tiny / "config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.7}))
    return out


def _builder(model_dir: Path) -> PromptBuilder:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return PromptBuilder.for_model(model_dir, tok, tok.get_vocab_size())


def test_without_a_template_chat_keeps_the_plain_framing(tiny: Path) -> None:
    builder = _builder(tiny)
    assert builder.template is None
    tok = builder.tokenizer
    ids = builder.chat([("user", "hi there")]).token_ids
    bos = builder.bos_token_id  # config.json's, in front of the plain framing
    assert bos is not None
    expected = [bos, *tok.encode(frame_message("user", "hi there"), add_special_tokens=False).ids,
                *tok.encode(ASSISTANT_PREFIX, add_special_tokens=False).ids]
    assert ids == expected
    # a plain prompt is the tokenizer's own encoding: this one adds no bos
    assert builder.text_ids("hi there") == tok.encode("hi there").ids
    assert builder.text_ids("hi there")[0] != bos


def test_stop_ids_and_sampling_defaults_come_from_the_model(tiny: Path, chatml: Path) -> None:
    config = ModelConfig.from_dir(chatml)
    im_end = Tokenizer.from_file(str(chatml / "tokenizer.json")).token_to_id("<|im_end|>")
    assert config.eos_token_ids == (2, im_end)  # generation_config's, then the tokenizer's
    assert config.sampling_defaults == SamplingDefaults(temperature=0.7, top_p=1.0, top_k=50)
    assert ModelConfig.from_dir(tiny).sampling_defaults == SamplingDefaults()  # greedy


def test_the_next_turn_starts_with_the_ids_that_were_generated(chatml: Path) -> None:
    builder = _builder(chatml)
    tok = builder.tokenizer
    eos = tok.token_to_id("<|im_end|>")
    first = [("user", "tell me about the river")]
    turn1 = builder.chat(first)
    answer = "the river runs to the sea"
    # The model spelled its answer one byte-level character at a time: valid ids for
    # the same text, but not what tokenizing the text again gives.
    generated = [tok.token_to_id("Ġ" if c == " " else c) for c in answer] + [eos]
    assert tok.decode(generated[:-1]) == answer
    builder.remember(turn1.chat, generated, answer, [2, eos])

    second = [*first, ("assistant", answer), ("user", "and then?")]
    ids = builder.chat(second).token_ids
    fresh = tok.encode(builder.template.render(
        [{"role": r, "content": c} for r, c in second]), add_special_tokens=False).ids
    assert ids != fresh
    kept = [*turn1.token_ids, *generated[:-1]]
    assert ids[:len(kept)] == kept
    assert ids[len(kept)] == eos  # the template's end of turn, then the new text as is
    tail = fresh[fresh.index(eos, len(turn1.token_ids)):]
    assert ids[len(kept):] == tail

    # The answer came back changed, or under another adapter: the plain tokenization.
    edited = [*first, ("assistant", answer + "!"), ("user", "and then?")]
    assert builder.chat(edited).token_ids == tok.encode(builder.template.render(
        [{"role": r, "content": c} for r, c in edited]), add_special_tokens=False).ids
    assert builder.chat(second, adapter="other").token_ids == fresh


def test_generated_ids_that_do_not_spell_the_answer_are_not_remembered(chatml: Path) -> None:
    builder = _builder(chatml)
    turn1 = builder.chat([("user", "hi")])
    builder.remember(turn1.chat, builder.tokenizer.encode("hello").ids, "goodbye", [2])
    assert len(builder.turns) == 0


def test_turn_memory_evicts_the_least_recently_used_past_its_budget() -> None:
    from array import array

    def turn(n: int) -> RememberedTurn:
        return RememberedTurn("p", array("l", [1] * n), array("l", [2] * n), "a")

    memory = TurnMemory(max_tokens=100)
    memory.put(b"a", turn(20))
    memory.put(b"b", turn(20))
    assert memory.get(b"a") is not None  # now the most recent
    memory.put(b"c", turn(20))
    assert memory.get(b"b") is None and memory.get(b"a") is not None
    memory.put(b"huge", turn(60))  # larger than the whole budget: not kept
    assert memory.get(b"huge") is None and len(memory) == 2
