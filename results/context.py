"""What the worker remembers about one in-flight request, from read to terminal event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ingest.prompting import IncrementalDecoder
from schemas import InferenceRequest


@dataclass(slots=True)
class InFlight:
    request: InferenceRequest
    topic_partition: Any  # aiokafka TopicPartition of the request record
    offset: int
    reply_topic: str
    attempt: int
    arrival_time: float  # broker timestamp, seconds
    max_ttft_ms: int
    decoder: IncrementalDecoder
    num_prompt_tokens: int = 0
    next_seq: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
