"""What the worker remembers about one request, from admission to its terminal event.

The one in-flight record of a request: made when ingest admits it, handed to
the engine as the request's `origin` (it comes back in every engine event),
and used to answer it (reply topic, attempt, detokenizer, event sequence) and
to finish its offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.tracing import Headers
from results.detokenize import IncrementalDecoder
from schemas import InferenceRequest


@dataclass(slots=True)
class InFlight:
    request: InferenceRequest
    topic_partition: Any  # the request record's aiokafka TopicPartition
    offset: int
    reply_topic: str
    attempt: int
    arrival_time: float  # the broker's timestamp of the record, seconds
    max_ttft_ms: int  # what the request was allowed: reported in its timeout
    decoder: IncrementalDecoder
    num_prompt_tokens: int = 0
    chat: Any = None  # ingest's rendered chat prompt, remembered for the next turn
    next_seq: int = 0  # of its next token event
    tenant: str | None = None  # whose key sent it: only that tenant may cancel it
    key_digest: bytes | None = None  # of its authorization header (a cancel's fast check)
    epoch: int = 0  # of the partition's assignment it was read under
    tool_format: str | None = None  # how the model writes tool calls, when it may make some
    # The W3C trace context its reply records carry (`common.tracing`): the worker's span
    # of the request, or with tracing off the request record's own; None without one.
    reply_headers: Headers | None = None
    trace: Any = None  # the worker's record of its trace (`worker.tracing`), when on

    @property
    def request_id(self) -> str:
        return self.request.request_id
