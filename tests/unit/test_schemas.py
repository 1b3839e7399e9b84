"""Wire schemas: strict validation, stable round trips, and one error type for bad bytes."""

from __future__ import annotations

import contextlib

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    REPLY_EVENT_ADAPTER,
    ComputeConfig,
    DeadLetterRecord,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    InferenceRequest,
    ModelDeployment,
    Placement,
    SchemaError,
    TimeoutEvent,
    TimeoutRecord,
    TokenEvent,
    decode,
    encode,
)
from schemas.export import export_json_schemas

CONTRACT_REQUEST = {
    "v": 1, "request_id": "r-123", "session_id": "chat-42", "model": "tiny",
    "adapter": "support-bot", "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None,
    "stop": [], "max_ttft_ms": None, "reply_topic": "sluice.results",
    "stream": True, "metadata": {},
}

CONTRACT_EVENTS = [
    b'{"v":1,"type":"token","request_id":"r-123","attempt":0,"seq":0,"token_ids":[791],"text":"The"}',
    b'{"v":1,"type":"done","request_id":"r-123","attempt":0,"finish_reason":"stop","text":"...",'
    b'"usage":{"prompt_tokens":120,"cached_prompt_tokens":96,"completion_tokens":17},'
    b'"timing":{"queue_ms":3.1,"ttft_ms":41.0,"total_ms":230.5},"model":"tiny","adapter":"support-bot"}',
    b'{"v":1,"type":"error","request_id":"r-123","code":"unauthorized","message":"..."}',
    b'{"v":1,"type":"timeout","request_id":"r-123","waited_ms":60012,"max_ttft_ms":60000}',
]


def test_contract_request_decodes() -> None:
    req = decode(InferenceRequest, orjson.dumps(CONTRACT_REQUEST))
    assert req.messages is not None and req.messages[0].content == "hi"
    assert req.partition_key == "chat-42"
    assert decode(InferenceRequest, encode(req)) == req


@pytest.mark.parametrize("raw", CONTRACT_EVENTS)
def test_contract_events_decode(raw: bytes) -> None:
    event = REPLY_EVENT_ADAPTER.validate_json(raw, strict=True)
    assert event.request_id == "r-123"


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"max_tokens": "64"}, "max_tokens", "valid integer"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"model": "../etc"}, "model", "should match pattern"),
        ({"reply_topic": "a b"}, "reply_topic", "should match pattern"),
        ({"v": 2}, "v", "Input should be 1"),
        ({"prompt": "x"}, "", "exactly one of messages, prompt or prompt_token_ids"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "Input should"),
        ({"surprise": 1}, "surprise", "Extra inputs are not permitted"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids.1", "greater than or equal to 0"),
        ({"request_id": ""}, "request_id", "should match pattern"),
    ],
)
def test_bad_fields_name_the_field(change: dict, field: str, problem: str) -> None:
    body = {**CONTRACT_REQUEST, **change}
    if "prompt_token_ids" in change:
        body.pop("messages")
    with pytest.raises(SchemaError) as info:
        decode(InferenceRequest, orjson.dumps(body))
    assert info.value.is_json_object
    assert any(
        p.field.startswith(field) and problem in p.problem for p in info.value.problems
    ), str(info.value)


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xff\xfe", b"[1,2]", b"null", b'"str"', b"{" * 10, b"[" * 5000 + b"]" * 5000,
     b'{"a": 1e999999}', b'{"request_id": "\xed\xa0\x80"}'],
)
def test_garbage_raises_schema_error_only(raw: bytes) -> None:
    with pytest.raises(SchemaError):
        decode(InferenceRequest, raw)


def test_oversized_message_is_refused_before_parsing() -> None:
    body = {**CONTRACT_REQUEST, "messages": [{"role": "user", "content": "x" * 5_000_000}]}
    with pytest.raises(SchemaError, match="limit"):
        decode(InferenceRequest, orjson.dumps(body))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_schema_error(raw: bytes) -> None:
    with contextlib.suppress(SchemaError):
        decode(InferenceRequest, raw)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(
    st.sampled_from(sorted(CONTRACT_REQUEST)) | st.text(max_size=10), json_values, max_size=8,
))
def test_arbitrary_objects_decode_or_raise_schema_error(obj: dict) -> None:
    with contextlib.suppress(SchemaError):
        decode(InferenceRequest, orjson.dumps({**CONTRACT_REQUEST, **obj}))


names = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,20}", fullmatch=True)
ids = st.from_regex(r"[\x21-\x7e]{1,40}", fullmatch=True)
finite = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)

requests = st.builds(
    InferenceRequest,
    request_id=ids, session_id=st.none() | ids, model=names, adapter=st.none() | names,
    prompt=st.text(min_size=1, max_size=50), max_tokens=st.integers(1, 10_000),
    temperature=st.floats(0, 2, allow_nan=False), top_p=st.floats(0.01, 1, allow_nan=False),
    top_k=st.integers(0, 100), seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    max_ttft_ms=st.none() | st.integers(1, 100_000), stream=st.booleans(),
    metadata=st.dictionaries(st.text(max_size=8), json_values, max_size=3),
)
events = st.one_of(
    st.builds(TokenEvent, request_id=ids, attempt=st.integers(0, 5), seq=st.integers(0, 10**6),
              token_ids=st.lists(st.integers(0, 10**6), max_size=5), text=st.text(max_size=20)),
    st.builds(DoneEvent, request_id=ids, finish_reason=st.sampled_from(["stop", "length"]),
              text=st.text(max_size=20), model=names, adapter=st.none() | names,
              usage=st.builds(dict, prompt_tokens=st.integers(0, 10**6),
                              cached_prompt_tokens=st.integers(0, 10**6),
                              completion_tokens=st.integers(0, 10**6)),
              timing=st.builds(dict, queue_ms=finite, ttft_ms=finite, total_ms=finite)),
    st.builds(ErrorEvent, request_id=ids, code=st.sampled_from(list(ErrorCode)),
              message=st.text(max_size=30)),
    st.builds(TimeoutEvent, request_id=ids, waited_ms=finite, max_ttft_ms=st.integers(1, 10**7)),
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_requests_round_trip_byte_stable(req: InferenceRequest) -> None:
    raw = encode(req)
    again = decode(InferenceRequest, raw)
    assert again == req
    assert encode(again) == raw


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_events_round_trip_byte_stable(event) -> None:
    raw = encode(event)
    again = REPLY_EVENT_ADAPTER.validate_json(raw, strict=True)
    assert again == event
    assert encode(again) == raw


def test_other_records_round_trip() -> None:
    req = decode(InferenceRequest, orjson.dumps(CONTRACT_REQUEST))
    records = [
        TimeoutRecord(request_id="r-1", model="tiny", reason="max_ttft_ms passed in queue",
                      waited_ms=61000.5, max_ttft_ms=60000, request=req.model_dump(mode="json")),
        DeadLetterRecord.of(reason="bad", topic="sluice.requests.tiny", partition=0, offset=7,
                            key=b"k", value=b"\xff" * 10),
        ModelDeployment(model="tiny", revision=3, path="/m",
                        compute_config=ComputeConfig(kv_cache_len=300000, tp=4),
                        placement=Placement(compute_pools=["pool-1", "pool-2"])),
    ]
    for record in records:
        raw = encode(record)
        assert encode(decode(type(record), raw)) == raw
    assert records[1].value() == b"\xff" * 10


def test_compute_config_defaults_match_contract() -> None:
    assert ComputeConfig().max_adapters == 4
    assert ComputeConfig().quantization == "none"
    assert Placement().max_ttft_ms == 60_000
    with pytest.raises(SchemaError, match="quantization"):
        decode(ComputeConfig, b'{"quantization": "int3"}')


def test_export_writes_a_schema_per_message(tmp_path) -> None:
    paths = export_json_schemas(tmp_path)
    names = {p.name for p in paths}
    assert "inference_request.schema.json" in names and "reply_event.schema.json" in names
    schema = orjson.loads((tmp_path / "inference_request.schema.json").read_bytes())
    assert "request_id" in schema["properties"]


def test_sampling_left_out_stays_left_out_on_the_wire() -> None:
    import orjson

    from schemas import InferenceRequest, decode, encode

    plain = InferenceRequest(request_id="r", model="m", prompt="hi")
    wire = orjson.loads(encode(plain))
    assert not {"temperature", "top_p", "top_k"} & wire.keys()
    assert decode(InferenceRequest, encode(plain)).model_fields_set.isdisjoint({"temperature"})
    greedy = InferenceRequest(request_id="r", model="m", prompt="hi", temperature=0.0)
    assert orjson.loads(encode(greedy))["temperature"] == 0.0
    assert "temperature" in decode(InferenceRequest, encode(greedy)).model_fields_set
