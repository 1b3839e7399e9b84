"""JSON Schema files for every wire message (`sluice schemas export DIR`), and the
AsyncAPI document of the topics (`--asyncapi`, built in `schemas.asyncapi`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import orjson
from pydantic import BaseModel

from schemas import (
    REPLY_EVENT_ADAPTER,
    CancelRequest,
    ComputeConfig,
    DeadLetterRecord,
    DoneEvent,
    ErrorEvent,
    InferenceRequest,
    ModelDeployment,
    Placement,
    TimeoutEvent,
    TimeoutRecord,
    TokenEvent,
)
from schemas.asyncapi import TopicFacts, asyncapi_document

MODELS: dict[str, type[BaseModel]] = {
    "inference_request": InferenceRequest,
    "cancel_request": CancelRequest,
    "token_event": TokenEvent,
    "done_event": DoneEvent,
    "error_event": ErrorEvent,
    "timeout_event": TimeoutEvent,
    "timeout_record": TimeoutRecord,
    "deadletter_record": DeadLetterRecord,
    "model_deployment": ModelDeployment,
    "compute_config": ComputeConfig,
    "placement": Placement,
}

_JSON = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS


def json_schemas() -> dict[str, dict]:
    """Each exported file's JSON Schema, by file stem."""
    schemas = {name: model.model_json_schema() for name, model in MODELS.items()}
    schemas["reply_event"] = REPLY_EVENT_ADAPTER.json_schema()
    return schemas


def export_json_schemas(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in json_schemas().items():
        path = directory / f"{name}.schema.json"
        path.write_bytes(orjson.dumps(schema, option=_JSON))
        written.append(path)
    return written


def export_asyncapi(directory: Path, topics: Mapping[str, TopicFacts] | None = None) -> Path:
    """Write `asyncapi.json`, the AsyncAPI 3.0.0 document of the topics."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "asyncapi.json"
    path.write_bytes(orjson.dumps(asyncapi_document(topics), option=_JSON) + b"\n")
    return path
