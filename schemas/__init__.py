"""Wire formats: the only place message shapes live (CONTRACT.md, "Messages").

`decode(Model, data)` validates any bytes or raises `SchemaError`;
`encode(message)` gives canonical orjson bytes. `Outcome` / `outcome_of` state how a
reader turns one request's reply events into its outcome (`schemas.outcome`).
"""

from schemas.codec import MAX_MESSAGE_BYTES, FieldProblem, SchemaError, decode, encode, validate
from schemas.control import AdapterSpec, ComputeConfig, ModelDeployment, Placement
from schemas.events import (
    REPLY_EVENT_ADAPTER,
    TERMINAL_TYPES,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    ReplyEvent,
    TimeoutEvent,
    Timing,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from schemas.outcome import Outcome, outcome_of
from schemas.records import DeadLetterRecord, TimeoutRecord
from schemas.requests import (
    CancelRequest,
    ChatMessage,
    FunctionCall,
    InferenceRequest,
    NamedToolChoice,
    Tool,
    ToolCall,
    is_cancel,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "REPLY_EVENT_ADAPTER",
    "TERMINAL_TYPES",
    "AdapterSpec",
    "CancelRequest",
    "ChatMessage",
    "ComputeConfig",
    "DeadLetterRecord",
    "DoneEvent",
    "ErrorCode",
    "ErrorEvent",
    "FieldProblem",
    "FunctionCall",
    "InferenceRequest",
    "ModelDeployment",
    "NamedToolChoice",
    "Outcome",
    "Placement",
    "ReplyEvent",
    "SchemaError",
    "TimeoutEvent",
    "TimeoutRecord",
    "Timing",
    "TokenEvent",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "TopLogprob",
    "Usage",
    "decode",
    "encode",
    "is_cancel",
    "outcome_of",
    "validate",
]
