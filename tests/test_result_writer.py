"""ResultWriter.write: a terminal event that cannot be built still ends the request."""

from __future__ import annotations

import orjson
import pytest

from batcher import types as bt
from results.context import InFlight
from results.writer import ResultWriter
from schemas import InferenceRequest
from sluice.settings import Settings


class BrokenDecoder:
    """A detokenizer that fails, as one might on ids it cannot map."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def push(self, token_ids: list[int]) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    def text(self) -> str:
        return ""


def _ctx() -> InFlight:
    request = InferenceRequest(request_id="r-1", model="tiny", prompt="hi", stream=True)
    return InFlight(request=request, topic_partition=("sluice.requests.tiny", 0), offset=7,
                    reply_topic="sluice.results", attempt=0, arrival_time=0.0,
                    max_ttft_ms=1000, decoder=BrokenDecoder())


@pytest.fixture
async def writer(monkeypatch: pytest.MonkeyPatch) -> ResultWriter:
    settings = Settings(kafka_bootstrap="127.0.0.1:9", database_url="postgresql://unused")
    w = ResultWriter(settings, lambda tp, offset: None, "tiny")  # never started: no broker
    sent: list[tuple[str, bytes]] = []

    async def send_terminal(ctx: InFlight, value: bytes, tries_left: int) -> None:
        sent.append((ctx.request.request_id, value))

    async def send(topic: str, key: str, value: bytes) -> None:
        sent.append((key, value))

    monkeypatch.setattr(w, "_send_terminal", send_terminal)
    monkeypatch.setattr(w, "_send", send)
    w.sent = sent  # type: ignore[attr-defined]
    return w


async def test_done_that_cannot_be_built_becomes_an_internal_error(writer) -> None:
    ctx = _ctx()
    done = bt.DoneEvent(request_id="r-1#0:7", attempt=0, origin=ctx, finish_reason="length",
                        token_ids=(5, 6), usage=bt.Usage(3, 0, 2), timing=bt.Timing(1, 2, 3))
    await writer.write(done)
    ((request_id, value),) = writer.sent
    event = orjson.loads(value)
    assert request_id == "r-1"
    assert event["type"] == "error" and event["code"] == "internal"
    assert "UnicodeDecodeError" in event["message"]


async def test_a_token_event_that_cannot_be_built_is_skipped(writer) -> None:
    ctx = _ctx()
    await writer.write(bt.TokenEvent(request_id="r-1#0:7", attempt=0, origin=ctx, seq=0,
                                     token_ids=(5,)))
    assert writer.sent == []  # no terminal: the request goes on; its done event follows
