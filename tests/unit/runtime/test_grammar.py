"""Constrained decoding: JSON that parses and fits its schema, beside free rows."""

from __future__ import annotations

import json

import pytest

from gpu_runtime import Runtime, RuntimeConfig, SamplingParams, StepPlan
from gpu_runtime.grammar import GrammarError
from gpu_runtime.tiny import make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> Runtime:
    path = make_tiny_model(tmp_path_factory.mktemp("grammar") / "tiny")
    return Runtime(path, RuntimeConfig(kv_cache_len=4096))


def _run(rt: Runtime, params: dict[str, SamplingParams]) -> dict[str, list[int]]:
    prompts = {name: list(range(5 + i, 15 + i)) for i, name in enumerate(params)}
    for name, p in params.items():
        rt.add_sequence(name, prompts[name], p)
    out: dict[str, list[int]] = {name: [] for name in params}
    plan = {name: len(prompts[name]) for name in params}
    while plan:
        step = rt.execute(StepPlan(plan))
        for o in step.outputs:
            out[o.seq_id].append(o.token_id)
        plan = {s: 1 for s in rt.sequences}
    return out


def test_schema_rows_parse_and_free_rows_share_the_steps(runtime) -> None:
    schema = runtime.grammars.compile({"type": "json_schema",
                                       "json_schema": {"name": "t", "schema": SCHEMA}})
    anything = runtime.grammars.compile({"type": "json_object"})
    free = SamplingParams(max_tokens=40, ignore_eos=True)
    out = _run(runtime, {
        "schema": SamplingParams(max_tokens=200, temperature=1.0, seed=3, grammar=schema),
        "object": SamplingParams(max_tokens=200, grammar=anything),
        "free": free,
    })
    decode = runtime.tokenizer.decode
    value = json.loads(decode(out["schema"]))
    assert value["color"] in {"red", "green", "blue"} and 0 <= value["count"] <= 99
    assert isinstance(value["ok"], bool) and set(value) == {"color", "count", "ok"}
    assert len(out["object"]) < 200, decode(out["object"])  # ended by the grammar
    assert isinstance(json.loads(decode(out["object"])), dict)
    assert len(out["free"]) == 40  # untouched by the masks of its step-mates
    assert not runtime.sequences


def test_unservable_formats_are_refused(runtime) -> None:
    assert runtime.grammars.compile({"type": "text"}) is None
    with pytest.raises(GrammarError, match="json_schema"):
        runtime.grammars.compile({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(GrammarError):
        runtime.grammars.compile({"type": "xml"})
    with pytest.raises(GrammarError):
        runtime.grammars.compile({"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}})
