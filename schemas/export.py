"""JSON Schema files for every wire message (`sluice schemas export DIR`)."""

from __future__ import annotations

from pathlib import Path

import orjson
from pydantic import BaseModel

from schemas import (
    REPLY_EVENT_ADAPTER,
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

MODELS: dict[str, type[BaseModel]] = {
    "inference_request": InferenceRequest,
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


def export_json_schemas(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    schemas = {name: model.model_json_schema() for name, model in MODELS.items()}
    schemas["reply_event"] = REPLY_EVENT_ADAPTER.json_schema()
    for name, schema in schemas.items():
        path = directory / f"{name}.schema.json"
        path.write_bytes(orjson.dumps(schema, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        written.append(path)
    return written
