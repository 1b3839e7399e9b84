"""An AsyncAPI 3.0 document of sluice's topics (`sluice schemas export DIR --asyncapi`).

Everything about a message's fields comes from the pydantic models (their JSON
Schemas, descriptions included, under `components.schemas`, with pydantic's `$defs`
rewritten to `#/components/schemas/<name>`); this module adds only what the models
do not know: the topics, their keys and headers, and who sends and receives what.
What sluice's topic creation knows (partitions, topic configs) is handed in as
`TopicFacts`, since `schemas` sits below the code that creates topics.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from schemas.codec import encode
from schemas.control import ModelDeployment
from schemas.events import DoneEvent, ErrorCode, ErrorEvent, TimeoutEvent, Timing, TokenEvent, Usage
from schemas.names import ID_PATTERN, NAME_PATTERN
from schemas.records import DeadLetterRecord, TimeoutRecord
from schemas.requests import CancelRequest, ChatMessage, InferenceRequest

ASYNCAPI_VERSION = "3.0.0"
KAFKA_BINDING_VERSION = "0.5.0"
LOCAL_BROKER = "localhost:39092"  # `sluice infra up`'s default Kafka port
DEFAULT_VERSION = "0.1.0"

# Messages by topic role, in the order a reader meets them.
ROLES: dict[str, tuple[type[BaseModel], ...]] = {
    "requests": (InferenceRequest, CancelRequest),
    "replies": (TokenEvent, DoneEvent, ErrorEvent, TimeoutEvent),
    "timeouts": (TimeoutRecord,),
    "deadletter": (DeadLetterRecord,),
    "control": (ModelDeployment,),
}


@dataclass(frozen=True, slots=True)
class TopicFacts:
    """What sluice creates a topic with: its partition count (None when it varies) and
    topic configs (Kafka's names and string values)."""

    partitions: int | None = None
    configs: Mapping[str, str] = field(default_factory=dict)


def _key(description: str, pattern: str | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "description": description}
    if pattern is not None:
        schema["pattern"] = pattern
    return schema


_MURMUR2 = ("partitioned with murmur2 (the Java client's default; librdkafka producers set "
            "partitioner=murmur2_random)")
KEYS: dict[type[BaseModel], dict[str, Any]] = {
    InferenceRequest: _key("The session id, else the request id (UTF-8), " + _MURMUR2
                           + ", so a session's turns reach the same worker.", ID_PATTERN),
    CancelRequest: _key("The cancelled request's own key: its session id, else its request "
                        "id (UTF-8), " + _MURMUR2 + ".", ID_PATTERN),
    TimeoutRecord: _key("The request id (UTF-8).", ID_PATTERN),
    DeadLetterRecord: _key("The original record's key, as it was (no key when it had none)."),
    ModelDeployment: _key("The model key (UTF-8).", NAME_PATTERN),
}
for _event in ROLES["replies"]:
    KEYS[_event] = _key("The request id (UTF-8).", ID_PATTERN)

_TRACEPARENT = {
    "type": "string",
    "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$",
    "examples": ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"],
}
_TRACESTATE = {
    "type": "string",
    "description": "W3C `tracestate`, vendor trace data; passed on with `traceparent`.",
    "examples": ["acme=7"],
}

REQUEST_HEADERS: dict[str, Any] = {
    "type": "object",
    "description": ("Kafka record headers; sluice reads `authorization`, and `traceparent` "
                    "with `tracestate` (W3C trace context) when present."),
    "required": ["authorization"],
    "properties": {
        "traceparent": {**_TRACEPARENT, "description": (
            "Optional W3C `traceparent` of the producer's span: sluice continues that "
            "trace (its spans are children of it, with OpenTelemetry export on) and its "
            "reply records carry a `traceparent` of the same trace. An invalid one is "
            "ignored.")},
        "tracestate": _TRACESTATE,
        "authorization": {
            "type": "string",
            "description": (
                "`Bearer <api key>`, the key from `sluice keys create` "
                "(sk-sluice-<key id>.<secret>), granted the model (and adapter). Exactly one "
                "such header: none, several, or a key without the grant end the request with "
                "error unauthorized; a cancel is honoured only with a key of the request's "
                "tenant."),
            "examples": ["Bearer sk-sluice-<key id>.<secret>"],
        },
    },
}

REPLY_HEADERS: dict[str, Any] = {
    "type": "object",
    "description": ("Kafka record headers of a reply (and of its timeouts-log record), "
                    "present when its request carried a valid `traceparent` or when the "
                    "worker traces (OTEL_* settings)."),
    "properties": {
        "traceparent": {**_TRACEPARENT, "description": (
            "W3C `traceparent` naming the worker's span of the request (with tracing "
            "off: the request's own), in the request's trace: a consumer continues the "
            "trace from here. The same on every reply of one attempt.")},
        "tracestate": _TRACESTATE,
    },
}

_PREFIX = {"description": "SLUICE_TOPIC_PREFIX: the first part of every topic sluice creates.",
           "default": "sluice"}
PARAMETERS: dict[str, dict[str, Any]] = {
    "prefix": _PREFIX,
    "model": {"description": "The registered model's key (its request topic's last part)."},
    "replyTopic": {"description": "The request's reply_topic; <prefix>.results when null.",
                   "default": "sluice.results"},
}

CHANNELS: dict[str, dict[str, Any]] = {
    "requests": {
        "address": "{prefix}.requests.{model}",
        "title": "Requests of one model",
        "description": (
            "Producers' inference requests and cancels for one model. sluice creates it when "
            "the model is registered (never broker auto-creation), with "
            "message.timestamp.type=LogAppendTime: a request's first-token deadline counts "
            "from the broker's timestamp, so queue time counts. Records may use any Kafka "
            "codec and come from transactional producers (sluice reads read_committed)."),
    },
    "replies": {
        "address": "{replyTopic}",
        "title": "A reply topic",
        "description": (
            "The request's reply_topic (default <prefix>.results, which sluice creates at "
            "first start): an existing topic other than sluice's own request, control, "
            "timeout and dead-letter topics. Per request: token events (when streamed), "
            "then exactly one terminal event (done, error or timeout) per attempt. Other "
            "producers may share the topic: skip records that are not these events. Read "
            "read_committed (exactly_once models write terminal events in transactions)."),
    },
    "timeouts": {
        "address": "{prefix}.timeouts",
        "title": "Timed-out requests",
        "description": "A record of every request that timed out, with the request itself.",
    },
    "deadletter": {
        "address": "{prefix}.deadletter",
        "title": "Dead letters",
        "description": "Records that could not be answered on a reply topic, with the reason.",
    },
    "control": {
        "address": "{prefix}.control",
        "title": "Model deployments",
        "description": (
            "The control plane's desired state of each model, compacted: the newest record "
            "per model key is the truth; a null value (tombstone) removes the model."),
    },
}

# (operation id, action, channel, messages of that channel, summary)
OPERATIONS: list[tuple[str, str, str, tuple[type[BaseModel], ...], str]] = [
    ("sendInferenceRequest", "send", "requests", (InferenceRequest,),
     "Ask a model for a completion."),
    ("sendCancelRequest", "send", "requests", (CancelRequest,),
     "Stop a request sent earlier."),
    ("receiveReplies", "receive", "replies", ROLES["replies"],
     "Read a request's events, matched by request_id."),
    ("receiveTimeouts", "receive", "timeouts", ROLES["timeouts"],
     "Read the log of timed-out requests."),
    ("receiveDeadLetters", "receive", "deadletter", ROLES["deadletter"],
     "Read records that could not be answered."),
    ("receiveControl", "receive", "control", ROLES["control"],
     "Follow the models' deployments."),
]


def _summary(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or model.__name__).strip()
    return " ".join(doc.split("\n\n")[0].split())


def _examples() -> dict[type[BaseModel], tuple[BaseModel, ...]]:
    """One valid instance per client-facing message (built, so it cannot drift)."""
    request = InferenceRequest(request_id="r-123", session_id="chat-42", model="tiny",
                               adapter="support-bot", max_tokens=64,
                               messages=[ChatMessage(role="user", content="hi")])
    usage = Usage(prompt_tokens=120, cached_prompt_tokens=96, completion_tokens=17)
    timing = Timing(queue_ms=3.1, ttft_ms=41.0, total_ms=230.5)
    return {
        InferenceRequest: (request,),
        CancelRequest: (CancelRequest(request_id="r-123"),),
        TokenEvent: (TokenEvent(request_id="r-123", seq=0, token_ids=[791], text="The"),),
        DoneEvent: (DoneEvent(request_id="r-123", finish_reason="stop", text="The answer.",
                              usage=usage, timing=timing, model="tiny",
                              adapter="support-bot"),),
        ErrorEvent: (ErrorEvent(request_id="r-123", code=ErrorCode.UNAUTHORIZED,
                                message="unknown or revoked API key"),),
        TimeoutEvent: (TimeoutEvent(request_id="r-123", waited_ms=60012.0,
                                    max_ttft_ms=60000),),
    }


def _message(model: type[BaseModel], examples: tuple[BaseModel, ...]) -> dict[str, Any]:
    message: dict[str, Any] = {
        "name": model.__name__,
        "title": model.__name__,
        "summary": _summary(model),
        "description": inspect.cleandoc(model.__doc__ or model.__name__),
        "contentType": "application/json",
        "payload": {"$ref": f"#/components/schemas/{model.__name__}"},
        "bindings": {"kafka": {"key": KEYS[model], "bindingVersion": KAFKA_BINDING_VERSION}},
    }
    if model in ROLES["requests"]:
        message["headers"] = {"$ref": "#/components/schemas/RequestHeaders"}
    elif model in ROLES["replies"] or model in ROLES["timeouts"]:
        message["headers"] = {"$ref": "#/components/schemas/ReplyHeaders"}
    if "request_id" in model.model_fields:
        message["correlationId"] = {
            "description": "request_id ties a request to its events and records.",
            "location": "$message.payload#/request_id"}
    if examples:
        headers = ({"authorization": "Bearer sk-sluice-<key id>.<secret>"}
                   if model in ROLES["requests"] else
                   {"traceparent": _TRACEPARENT["examples"][0]})
        message["examples"] = [
            {"name": f"{model.__name__}-{i}",
             **({"headers": headers} if "headers" in message else {}),
             "payload": orjson.loads(encode(example))}
            for i, example in enumerate(examples)
        ]
    return message


def _channel_bindings(role: str, topics: Mapping[str, TopicFacts]) -> dict[str, Any]:
    kafka: dict[str, Any] = {}
    if role not in ("requests", "replies"):  # one topic of a known name (default prefix)
        kafka["topic"] = f"{_PREFIX['default']}.{role}"
    facts = topics.get(role) if role != "replies" else None
    if facts is not None and facts.partitions is not None:
        kafka["partitions"] = facts.partitions
    if facts is not None and facts.configs:
        config: dict[str, Any] = {}
        for name, value in facts.configs.items():
            if name == "cleanup.policy":
                config[name] = value.split(",")
            else:
                config[name] = int(value) if value.lstrip("-").isdigit() else value
        kafka["topicConfiguration"] = config
    return {"kafka": {**kafka, "bindingVersion": KAFKA_BINDING_VERSION}}


def _channels(topics: Mapping[str, TopicFacts]) -> dict[str, Any]:
    channels = {}
    for role, models in ROLES.items():
        spec = CHANNELS[role]
        address = spec["address"]
        channels[role] = {
            **spec,
            "parameters": {name: {"$ref": f"#/components/parameters/{name}"}
                           for name in PARAMETERS if "{" + name + "}" in address},
            "messages": {m.__name__: {"$ref": f"#/components/messages/{m.__name__}"}
                         for m in models},
            "bindings": _channel_bindings(role, topics),
        }
    return channels


def _operations() -> dict[str, Any]:
    operations = {}
    for op_id, action, channel, models, summary in OPERATIONS:
        operation: dict[str, Any] = {
            "action": action,
            "channel": {"$ref": f"#/channels/{channel}"},
            "summary": summary,
            "messages": [{"$ref": f"#/channels/{channel}/messages/{m.__name__}"}
                         for m in models],
        }
        if op_id == "sendInferenceRequest":
            operation["reply"] = {
                "address": {"description": "The request's reply_topic (<prefix>.results "
                                           "when null).",
                            "location": "$message.payload#/reply_topic"},
                "channel": {"$ref": "#/channels/replies"},
                "messages": [{"$ref": f"#/channels/replies/messages/{m.__name__}"}
                             for m in ROLES["replies"]],
            }
        operations[op_id] = operation
    return operations


def component_schemas() -> dict[str, Any]:
    """Every message's JSON Schema and the schemas they use, by name, with `$ref`s
    that resolve inside the AsyncAPI document (`#/components/schemas/<name>`)."""
    models = [m for role in ROLES.values() for m in role]
    _, top = models_json_schema([(m, "validation") for m in models],
                                ref_template="#/components/schemas/{model}")
    return {**top["$defs"], "RequestHeaders": REQUEST_HEADERS, "ReplyHeaders": REPLY_HEADERS}


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sluice-engine")
    except PackageNotFoundError:
        return DEFAULT_VERSION


def asyncapi_document(topics: Mapping[str, TopicFacts] | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of sluice's topics. `topics`: what is known of the
    topics sluice creates, by role ("requests", "timeouts", "deadletter", "control");
    a reply topic may be any topic, so none is known of it."""
    examples = _examples()
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "sluice",
            "version": package_version(),
            "description": (
                "sluice's Kafka wire: inference requests in on `<prefix>.requests.<model>`, "
                "token and terminal events out on the request's reply topic, plus sluice's "
                "own timeout, dead-letter and control topics. Every value is one UTF-8 JSON "
                "object with `v: 1`; topic names start with SLUICE_TOPIC_PREFIX (default "
                "sluice). sluice creates its topics itself. Fields may be added in later "
                "versions, never renamed or removed."),
        },
        "servers": {
            "local": {
                "host": LOCAL_BROKER,
                "protocol": "kafka",
                "description": ("An example: the local broker of `sluice infra up`. Elsewhere, "
                                "the brokers of SLUICE_KAFKA_BOOTSTRAP."),
            },
        },
        "defaultContentType": "application/json",
        "channels": _channels(topics or {}),
        "operations": _operations(),
        "components": {
            "schemas": component_schemas(),
            "messages": {m.__name__: _message(m, examples.get(m, ()))
                         for role in ROLES.values() for m in role},
            "parameters": PARAMETERS,
        },
    }
