"""`sluice schemas export`: a description on every field, and an AsyncAPI 3.0 document
that the official AsyncAPI 3.0.0 JSON Schema accepts (the copy npm's @asyncapi/specs
ships, fetched into the cache by `make setup`)."""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema
from typer.testing import CliRunner

from cli import app
from cli.schemas_cmd import topic_facts
from common.settings import Settings
from common.topics import shared_topics
from schemas import (
    CancelRequest,
    ChatMessage,
    DoneEvent,
    InferenceRequest,
    Timing,
    TokenEvent,
    Usage,
    encode,
)
from schemas.asyncapi import asyncapi_document, component_schemas
from schemas.export import MODELS, json_schemas

SPECS_DIR_ENV = "SLUICE_ASYNCAPI_SPECS_DIR"
SPECS_DIR_DEFAULT = Path.home() / ".cache" / "sluice" / "asyncapi-specs"
SPEC_FILE = Path("node_modules/@asyncapi/specs/schemas/3.0.0-without-$id.json")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "not", "contains")


# ---- every field has a description --------------------------------------------------


def schemas_in(schema: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (sub)schema of `schema`, with a path, by JSON Schema keywords only (so a
    `default` or `examples` value is never taken for a schema)."""
    if not isinstance(schema, dict):
        return
    yield where, schema
    for name, sub in schema.get("$defs", {}).items():
        yield from schemas_in(sub, f"{where}/$defs/{name}")
    for name, sub in schema.get("properties", {}).items():
        yield from schemas_in(sub, f"{where}/properties/{name}")
    for keyword in SUBSCHEMAS:
        yield from schemas_in(schema.get(keyword), f"{where}/{keyword}")
    for keyword in SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(keyword, [])):
            yield from schemas_in(sub, f"{where}/{keyword}/{i}")


def undescribed(schema: dict[str, Any], name: str) -> list[str]:
    """Paths of the fields (properties) and models (`$defs`) without a description."""
    missing = []
    for where, sub in schemas_in(schema, name):
        for field, prop in sub.get("properties", {}).items():
            if not str(prop.get("description", "")).strip():
                missing.append(f"{where}/properties/{field}")
        for model, definition in sub.get("$defs", {}).items():
            if not str(definition.get("description", "")).strip():
                missing.append(f"{where}/$defs/{model}")
    if "properties" in schema and not str(schema.get("description", "")).strip():
        missing.append(name)
    return missing


def test_every_exported_field_and_model_has_a_description() -> None:
    missing = [path for name, schema in json_schemas().items()
               for path in undescribed(schema, name)]
    assert not missing, "fields or models without a description:\n" + "\n".join(missing)


def test_every_asyncapi_schema_has_descriptions() -> None:
    schemas = component_schemas()
    missing = [path for name, schema in schemas.items()
               for path in undescribed(schema, f"components/schemas/{name}")]
    assert not missing, "\n".join(missing)
    assert all(str(s.get("description", "")).strip() for s in schemas.values())


def test_the_description_check_finds_a_field_without_one() -> None:
    class Inner(BaseModel):
        """Described."""

        bare: int

    class Outer(BaseModel):
        """Described too."""

        inner: Inner = Field(description="has one")
        items: list[Inner] = Field(description="has one")

    missing = undescribed(Outer.model_json_schema(), "Outer")
    assert missing == ["Outer/$defs/Inner/properties/bare"]


def test_cancel_requests_are_exported() -> None:
    assert MODELS["cancel_request"] is CancelRequest
    schema = json_schemas()["cancel_request"]
    assert schema["properties"]["type"]["const"] == "cancel"


def test_descriptions_leave_the_wire_as_it_was() -> None:
    """The bytes `encode` gives (and so the wire) do not depend on the descriptions."""
    request = InferenceRequest(request_id="r-123", session_id="chat-42", model="tiny",
                               messages=[ChatMessage(role="user", content="hi")],
                               max_tokens=64, stop=["\n"])
    assert encode(request) == (
        b'{"v":1,"request_id":"r-123","session_id":"chat-42","model":"tiny","adapter":null,'
        b'"messages":[{"role":"user","content":"hi"}],"prompt":null,"prompt_token_ids":null,'
        b'"max_tokens":64,"seed":null,"stop":["\\n"],"max_ttft_ms":null,"reply_topic":null,'
        b'"stream":true,"metadata":{},"logprobs":null,"response_format":null}')
    assert encode(CancelRequest(request_id="r-123")) == (
        b'{"v":1,"type":"cancel","request_id":"r-123"}')
    assert encode(TokenEvent(request_id="r", seq=0, token_ids=[791], text="The")) == (
        b'{"v":1,"request_id":"r","type":"token","attempt":0,"seq":0,"token_ids":[791],'
        b'"text":"The","logprobs":null}')
    done = DoneEvent(request_id="r", finish_reason="stop", text="...",
                     usage=Usage(prompt_tokens=1, cached_prompt_tokens=0, completion_tokens=2),
                     timing=Timing(queue_ms=1.0, ttft_ms=2.0, total_ms=3.0), model="tiny")
    assert encode(done) == (
        b'{"v":1,"request_id":"r","type":"done","attempt":0,"finish_reason":"stop",'
        b'"text":"...","token_ids":null,"usage":{"prompt_tokens":1,"cached_prompt_tokens":0,'
        b'"completion_tokens":2},"timing":{"queue_ms":1.0,"ttft_ms":2.0,"total_ms":3.0},'
        b'"model":"tiny","adapter":null,"logprobs":null}')


# ---- the AsyncAPI document -----------------------------------------------------------


def asyncapi_spec() -> dict[str, Any]:
    """The official AsyncAPI 3.0.0 JSON Schema; missing is a failure, never a skip."""
    specs_dir = Path(os.environ.get(SPECS_DIR_ENV) or SPECS_DIR_DEFAULT)
    path = specs_dir / SPEC_FILE
    if not path.is_file():
        pytest.fail(f"the AsyncAPI 3.0.0 JSON Schema is missing at {path}: run `make setup` "
                    f"(infra/system-deps.sh fetches npm's @asyncapi/specs there), or point "
                    f"{SPECS_DIR_ENV} at an npm prefix that has it")
    return orjson.loads(path.read_bytes())


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return asyncapi_document(topic_facts())


@functools.cache
def asyncapi_validator() -> jsonschema.protocols.Validator:
    """Called inside each test (not a fixture), so a missing schema fails the test."""
    spec = asyncapi_spec()
    cls = jsonschema.validators.validator_for(spec)
    assert cls is jsonschema.Draft7Validator, spec.get("$schema")
    return cls(spec)


def test_document_validates_against_the_asyncapi_schema(document) -> None:
    validator = asyncapi_validator()
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}"
              for e in validator.iter_errors(document)]
    assert not errors, "\n".join(errors)
    assert document["asyncapi"] == "3.0.0"


@pytest.mark.parametrize("breakage", ["no operation channel", "cleanup.policy not a list",
                                      "unknown action"])
def test_a_broken_document_fails_validation(document, breakage: str) -> None:
    validator = asyncapi_validator()
    validator.validate(document)  # whole, it passes
    broken = copy.deepcopy(document)
    if breakage == "no operation channel":
        del broken["operations"]["sendInferenceRequest"]["channel"]
    elif breakage == "cleanup.policy not a list":
        broken["channels"]["control"]["bindings"]["kafka"]["topicConfiguration"][
            "cleanup.policy"] = "compact"
    else:
        broken["operations"]["receiveReplies"]["action"] = "poll"
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


def refs_in(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from refs_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs_in(value)


def resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"{ref} points outside the document"
    node: Any = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def test_every_ref_resolves_inside_the_document(document) -> None:
    refs = set(refs_in(document))
    assert "#/components/schemas/ChatMessage" in refs  # pydantic's $defs, rewritten
    assert not any("$defs" in ref for ref in refs)
    for ref in refs:
        resolve(document, ref)


def test_examples_fit_their_payload_and_headers(document) -> None:
    """Each message example validates against its own schemas, as referenced."""
    checked = 0
    for name, message in document["components"]["messages"].items():
        for example in message.get("examples", []):
            for part in ("payload", "headers"):
                if part not in message:
                    continue
                schema = {**message[part], "components": document["components"]}
                jsonschema.Draft202012Validator(schema).validate(example[part])
                checked += 1
        assert message["contentType"] == "application/json", name
    assert checked >= 8


def test_channels_topics_keys_and_headers(document) -> None:
    channels = document["channels"]
    assert channels["requests"]["address"] == "{prefix}.requests.{model}"
    assert set(channels["requests"]["messages"]) == {"InferenceRequest", "CancelRequest"}
    assert set(channels["replies"]["messages"]) == {
        "TokenEvent", "DoneEvent", "ErrorEvent", "TimeoutEvent"}
    assert channels["replies"]["address"] == "{replyTopic}"
    assert document["components"]["parameters"]["prefix"]["default"] == "sluice"
    control = channels["control"]["bindings"]["kafka"]
    assert control["topicConfiguration"]["cleanup.policy"] == ["compact"]
    # Partition counts are the ones sluice creates its topics with.
    settings = Settings()
    for spec in shared_topics(settings):
        role = spec.name.removeprefix(settings.topic(""))
        if role in channels:
            assert channels[role]["bindings"]["kafka"]["partitions"] == spec.partitions
    requests = channels["requests"]["bindings"]["kafka"]["topicConfiguration"]
    assert requests["message.timestamp.type"] == "LogAppendTime"
    messages = document["components"]["messages"]
    request = messages["InferenceRequest"]
    assert "session id" in request["bindings"]["kafka"]["key"]["description"]
    headers = resolve(document, request["headers"]["$ref"])
    assert headers["required"] == ["authorization"]
    assert "request id" in messages["DoneEvent"]["bindings"]["kafka"]["key"]["description"]
    assert {op["action"] for op in document["operations"].values()} == {"send", "receive"}


def test_component_schemas_are_pydantics_own(document) -> None:
    """No hand-kept copy of a field list: the schemas are what pydantic generates."""
    _, top = models_json_schema([(InferenceRequest, "validation")],
                                ref_template="#/components/schemas/{model}")
    for name, schema in top["$defs"].items():
        assert document["components"]["schemas"][name] == schema


def test_cli_writes_the_asyncapi_document(tmp_path, document) -> None:
    runner = CliRunner()
    plain = runner.invoke(app, ["schemas", "export", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    assert not (tmp_path / "plain" / "asyncapi.json").exists()
    assert (tmp_path / "plain" / "cancel_request.schema.json").is_file()
    result = runner.invoke(app, ["schemas", "export", str(tmp_path / "out"), "--asyncapi"])
    assert result.exit_code == 0, result.output
    written = orjson.loads((tmp_path / "out" / "asyncapi.json").read_bytes())
    assert written == document
