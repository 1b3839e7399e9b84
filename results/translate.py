"""Pure translation: what a request's outcome is on the wire. No I/O.

Each method returns the records to write (`WireRecord`: topic, key, value);
`results.delivery` writes them. Token events advance the request's detokenizer
and event sequence; the done event carries the text the token events added up
to (a held-back UTF-8 tail goes out first as a last, token-less event).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from common import tool_formats
from common.tracing import Headers
from results.inflight import InFlight
from schemas import (
    DeadLetterRecord,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    FunctionCall,
    TimeoutEvent,
    TimeoutRecord,
    Timing,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    encode,
)

# What the runtime gives per token: (logprob, ((token id, logprob), ...)).
RawLogprob = tuple[float, Sequence[tuple[int, float]]]


@dataclass(frozen=True, slots=True)
class WireRecord:
    topic: str
    key: bytes | None
    value: bytes
    headers: Headers | None = None  # the request's trace context (`common.tracing`)


@dataclass(frozen=True, slots=True)
class Translator:
    model: str
    timeouts_topic: str
    deadletter_topic: str

    def tokens(self, ctx: InFlight, token_ids: list[int],
               logprobs: Sequence[RawLogprob] | None = None) -> WireRecord | None:
        """A token event (None when the request is not streamed); the detokenizer keeps
        every token either way, so the done event's text is complete."""
        if not ctx.request.stream:
            ctx.decoder.ids.extend(token_ids)  # decoded once, for the done event
            return None
        return self._token_event(ctx, token_ids, ctx.decoder.push(token_ids),
                                 self._logprobs(ctx, token_ids, logprobs))

    def _token_event(self, ctx: InFlight, token_ids: list[int], text: str,
                     logprobs: list[TokenLogprob] | None = None) -> WireRecord:
        event = TokenEvent(request_id=ctx.request_id, attempt=ctx.attempt, seq=ctx.next_seq,
                           token_ids=token_ids, text=text, logprobs=logprobs)
        ctx.next_seq += 1
        return self._reply(ctx, encode(event))

    def done(self, ctx: InFlight, *, finish_reason: str, token_ids: list[int],
             num_cached_prompt_tokens: int, timing: Timing, adapter: str | None,
             logprobs: Sequence[RawLogprob] | None = None) -> list[WireRecord]:
        """The done event — after a last token-less event with any text held back."""
        seen = len(ctx.decoder.ids)
        if len(token_ids) > seen:
            ctx.decoder.push(token_ids[seen:])
        records = []
        if ctx.request.stream:
            tail = ctx.decoder.flush()
            if tail:
                records.append(self._token_event(ctx, [], tail))
            text = ctx.decoder.emitted
        else:
            text = ctx.decoder.text()
        content, calls = (None, None)
        if ctx.tool_format is not None and finish_reason in ("stop", "length"):
            content, calls = self._tool_calls(ctx, token_ids, text)
            if calls:
                finish_reason = "tool_calls"
        event = DoneEvent(
            request_id=ctx.request_id, attempt=ctx.attempt,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            text=text, tool_calls=calls, content=content, token_ids=list(token_ids),
            usage=Usage(prompt_tokens=ctx.num_prompt_tokens,
                        cached_prompt_tokens=num_cached_prompt_tokens,
                        completion_tokens=len(token_ids)),
            timing=timing, model=self.model, adapter=adapter,
            logprobs=self._logprobs(ctx, token_ids, logprobs),
        )
        return [*records, self._reply(ctx, encode(event))]

    @staticmethod
    def _tool_calls(ctx: InFlight, token_ids: list[int],
                    text: str) -> tuple[str | None, list[ToolCall] | None]:
        """The calls in a generated answer, parsed in the model's own format (a format
        whose marker is a special token is read from the text with special tokens)."""
        fmt = ctx.tool_format
        content, calls = tool_formats.parse(fmt, text)  # type: ignore[arg-type]
        tokenizer = ctx.decoder.tokenizer
        if not calls and fmt == "mistral" and tokenizer is not None:
            raw = tokenizer.decode(token_ids, skip_special_tokens=False)
            content, calls = tool_formats.parse(fmt, raw)
        if not calls:
            return None, None
        return content, [
            ToolCall(id=_call_id(ctx.request_id, i), function=FunctionCall(
                name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)))
            for i, c in enumerate(calls)]

    @staticmethod
    def _logprobs(ctx: InFlight, token_ids: list[int],
                  raw: Sequence[RawLogprob] | None) -> list[TokenLogprob] | None:
        """The runtime's (logprob, ((id, logprob), ...)) per token, with each token's
        own text (decoded alone, as OpenAI reports it)."""
        if raw is None or not token_ids:
            return None
        tokenizer = ctx.decoder.tokenizer

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""

        def clamp(value: float) -> float:
            return value if value > -9999.0 else -9999.0  # -inf (and nan): OpenAI's floor

        return [
            TokenLogprob(token_id=tid, token=decode([tid]), logprob=clamp(lp),
                         top_logprobs=[TopLogprob(token_id=t, token=decode([t]),
                                                  logprob=clamp(v)) for t, v in top])
            for tid, (lp, top) in zip(token_ids, raw, strict=True)
        ]

    def error(self, ctx: InFlight, code: ErrorCode, message: str) -> WireRecord:
        event = ErrorEvent(request_id=ctx.request_id, attempt=ctx.attempt, code=code,
                           message=message)
        return self._reply(ctx, encode(event))

    @staticmethod
    def refusal(reply_topic: str, request_id: str, code: ErrorCode, message: str,
                headers: Headers | None = None) -> WireRecord:
        """The error event of a request that never became an in-flight one."""
        event = ErrorEvent(request_id=request_id, code=code, message=message)
        return WireRecord(reply_topic, request_id.encode(), encode(event), headers)

    def timeout(self, ctx: InFlight, waited_ms: float,
                reason: str) -> tuple[WireRecord, WireRecord]:
        """(the record on the timeouts topic, the timeout event)."""
        event = TimeoutEvent(request_id=ctx.request_id, attempt=ctx.attempt,
                             waited_ms=waited_ms, max_ttft_ms=ctx.max_ttft_ms)
        record = TimeoutRecord(
            request_id=ctx.request_id, model=self.model, attempt=ctx.attempt, reason=reason,
            waited_ms=waited_ms, max_ttft_ms=ctx.max_ttft_ms,
            request=ctx.request.model_dump(mode="json", by_alias=True),
        )
        return (WireRecord(self.timeouts_topic, ctx.request_id.encode(), encode(record),
                           ctx.reply_headers),
                self._reply(ctx, encode(event)))

    def dead_letter(self, *, topic: str, partition: int, offset: int, key: bytes | None,
                    value: bytes, reason: str) -> WireRecord:
        """A record that cannot be answered, with the reason and where it was."""
        record = DeadLetterRecord.of(reason=reason, topic=topic, partition=partition,
                                     offset=offset, key=key, value=value)
        return WireRecord(self.deadletter_topic, key, encode(record))

    def undeliverable(self, ctx: InFlight, why: str) -> WireRecord:
        """A request whose terminal event its reply topic would not take, dead-lettered
        under the request record's own key."""
        tp = ctx.topic_partition
        reason = (f"the request's terminal event could not be written to its reply topic "
                  f"{ctx.reply_topic!r}: {why}")
        return self.dead_letter(topic=tp.topic, partition=tp.partition, offset=ctx.offset,
                                key=ctx.request.partition_key.encode(),
                                value=encode(ctx.request), reason=reason)

    @staticmethod
    def _reply(ctx: InFlight, value: bytes) -> WireRecord:
        return WireRecord(ctx.reply_topic, ctx.request_id.encode(), value, ctx.reply_headers)


def _call_id(request_id: str, index: int) -> str:
    """A call's id: the same for the same request and place (a retried attempt's calls
    keep their ids)."""
    digest = hashlib.sha256(f"{request_id}\0{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"
