"""A poll's Kafka error: the consumer hands its group coordinator's errors (an
UnknownError while a leader is cut off from its followers, say) to the next poll and
goes on coordinating, so the worker waits them out with its status saying why; only a
denied topic or group, which no wait mends, stops it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    KafkaError,
    TopicAuthorizationFailedError,
    UnknownError,
)

from ingest.offsets import OffsetTracker
from worker import intake as intake_module
from worker.intake import Intake
from worker.metrics import WorkerMetrics
from worker.requests import HeldRequests


@dataclass
class _Options:
    request_topic: str = "sluice.requests.tiny"


@dataclass
class _Polls:
    """What the consumer's successive polls do: raise the error given, or return."""

    outcomes: list[KafkaError | None]
    options: _Options = field(default_factory=_Options)
    calls: int = 0

    async def poll(self, max_records: int) -> None:
        outcome = self.outcomes[self.calls]
        self.calls += 1
        if outcome is not None:
            raise outcome


def _intake() -> Intake:
    return Intake(None, held=HeldRequests(), tracker=OffsetTracker(),  # type: ignore[arg-type]
                  metrics=WorkerMetrics("tiny", "default"))


def test_coordinator_error_is_waited_out_and_status_follows(monkeypatch):
    monkeypatch.setattr(intake_module, "POLL_RETRY_S", 0.01)
    polls = _Polls([UnknownError("coordinator"), UnknownError("again"), None, None])
    statuses: list[str] = []
    intake = _intake()

    async def run() -> None:
        for _ in range(4):
            await intake.poll(polls, on_wait=statuses.append,  # type: ignore[arg-type]
                              on_reading=lambda: statuses.append("reading"))

    asyncio.run(run())
    assert polls.calls == 4
    assert statuses == ["Kafka: UnknownError: [Error -1] UnknownError: coordinator",
                        "Kafka: UnknownError: [Error -1] UnknownError: again",
                        "reading"]  # said once, when reading again


@pytest.mark.parametrize("denied", [TopicAuthorizationFailedError, GroupAuthorizationFailedError])
def test_denied_topic_or_group_stops_the_worker(denied):
    polls = _Polls([denied()])
    with pytest.raises(denied):
        asyncio.run(_intake().poll(polls, on_wait=lambda _why: None,  # type: ignore[arg-type]
                                   on_reading=lambda: None))
