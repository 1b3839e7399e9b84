"""An idempotent producer the broker refuses for its sequence numbers, replaced.

An idempotent producer numbers each partition's batches, and a broker that sees a gap
refuses the batch with OutOfOrderSequenceNumber. aiokafka (0.14) keeps the numbers it
had, so every later batch of that partition is refused as well, for as long as the
producer lives (aio-libs/aiokafka#1017). In `sluice bench chaos --networked` it came
right after a leader's isolation, on the SDK's producer: about half the partitions
refused every send to the end of the run. Java's producer bumps its epoch there and
sends the batch again; aiokafka cannot, so the producer is replaced — a new producer id,
numbers from 0 — and the refused record is sent once more through the new one, as the
Java producer does. The broker that refused it did not write it.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer
from aiokafka.errors import OutOfOrderSequenceNumber

log = logging.getLogger(__name__)

# Producers being stopped after their replacement: held here so the task is not
# collected half-way.
_retiring: set[asyncio.Task[None]] = set()


def sequence_refused(exc: BaseException | None) -> bool:
    """Whether a send failed because the producer's sequence numbers no longer fit the
    broker's: the producer is unusable for that partition, the record was not written."""
    return isinstance(exc, OutOfOrderSequenceNumber)


def retire(producer: AIOKafkaProducer, what: str) -> None:
    """Stop a replaced producer in the background: what it still holds is delivered or
    fails to its senders (a refused one renews and resends), and a failure to stop is
    logged, not raised into whoever replaced it."""

    async def stop() -> None:
        try:
            await producer.stop()
        except Exception as exc:  # it was broken already; nothing else depends on it
            log.warning("stopping %s's replaced producer failed: %s: %s", what,
                        type(exc).__name__, exc)

    task = asyncio.get_running_loop().create_task(stop())
    _retiring.add(task)
    task.add_done_callback(_retiring.discard)


async def retired() -> None:
    """Wait until every replaced producer has stopped (a client closing waits for them,
    so none outlives it)."""
    if _retiring:
        await asyncio.gather(*_retiring, return_exceptions=True)


def say_renewed(what: str, exc: BaseException) -> None:
    log.warning("%s: the broker refused a batch for its sequence number (%s); a new "
                "producer takes over and the record is sent again", what, exc)
