"""A request's way through the worker without Kafka: ingest's verdicts routed (admitted
to a real engine over the fake runtime, refused and dead-lettered to results), engine
events pumped to results over a fake producer, offsets finished, and waits that end on
events (nothing held, the pump idle) rather than on sleeps."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson
import pytest
from aiokafka import TopicPartition

from batcher.config import BatcherConfig
from batcher.engine import Engine
from ingest.verdicts import Admitted, DeadLettered, Refused
from results.writer import ResultsOptions, ResultWriter
from schemas import ErrorCode, InferenceRequest
from tests.unit.batcher.fake_runtime import FakeRuntime
from tests.unit.fake_producer import FakeProducer
from worker.requests import EventPump, HeldRequests, Router, engine_key

TP = TopicPartition("sluice.requests.tiny", 1)


def _admitted(offset: int, *, max_ttft_ms: int = 60_000, arrival: float | None = None,
              tokens: list[int] | None = None) -> Admitted:
    request = InferenceRequest(request_id=f"r-{offset}", model="tiny",
                               prompt_token_ids=[1, 2, 3], max_tokens=3, stream=True,
                               reply_topic="replies")
    return Admitted(request, TP, offset, 0, "replies",
                    arrival_time=time.time() if arrival is None else arrival,
                    max_ttft_ms=max_ttft_ms,
                    token_ids=[1, 2, 3 + offset] if tokens is None else tokens)


@dataclass
class Flow:
    router: Router
    pump: EventPump
    engine: Engine
    held: HeldRequests
    writer: ResultWriter
    producer: FakeProducer
    finished: list[int]


def _results() -> tuple[FakeProducer, list[int], ResultWriter]:
    """A result writer over a fake producer, and the offsets it reports finished."""
    producer = FakeProducer(topics={"replies", "sluice.timeouts", "sluice.deadletter"})
    finished: list[int] = []
    writer = ResultWriter(ResultsOptions("tiny", "sluice.timeouts", "sluice.deadletter", {}, 1.0),
                          lambda tp, offset: finished.append(offset), producer=producer)
    return producer, finished, writer


@pytest.fixture
async def flow():
    producer, finished, writer = _results()
    engine = Engine(FakeRuntime(), BatcherConfig())
    await engine.start()
    held = HeldRequests()
    pump = EventPump(writer, held, engine)
    pumping = asyncio.create_task(pump.run())
    router = Router(writer, held, lambda: engine, lambda: None)
    yield Flow(router, pump, engine, held, writer, producer, finished)
    pumping.cancel()
    await engine.stop()


def _events(producer: FakeProducer, topic: str = "replies") -> list[dict]:
    return [orjson.loads(v) for v in producer.values(topic)]


async def test_every_verdict_ends_in_one_answer_and_a_finished_offset(flow) -> None:
    router, held, producer = flow.router, flow.held, flow.producer
    await router.route(_admitted(0))
    await router.route(_admitted(1, arrival=time.time() - 5, max_ttft_ms=1000, tokens=[]))
    await router.route(Refused(TP, 2, "replies", "r-2", ErrorCode.UNAUTHORIZED, "no grant"))
    await router.route(DeadLettered(TP, 3, b"k", b"\xff", "undecodable request"))
    assert await held.wait_empty(10)
    assert await flow.pump.wait_idle(flow.engine)
    await flow.writer.flush()
    terminal = {e["request_id"]: e for e in _events(producer) if e["type"] != "token"}
    assert terminal["r-0"]["type"] == "done" and terminal["r-0"]["token_ids"]
    # Late when admitted (it outwaited the permission database): the engine times it out.
    assert terminal["r-1"]["type"] == "timeout" and terminal["r-1"]["max_ttft_ms"] == 1000
    (log,) = _events(producer, "sluice.timeouts")
    assert "permission database unavailable" in log["reason"]
    assert terminal["r-2"]["code"] == "unauthorized"
    (letter,) = _events(producer, "sluice.deadletter")
    assert letter["offset"] == 3
    assert sorted(flow.finished) == [0, 1, 2, 3]


async def test_a_record_read_twice_is_admitted_once(flow) -> None:
    admitted = _admitted(5)
    flow.held.hold(engine_key(admitted), None)  # type: ignore[arg-type]
    await flow.router.route(admitted)  # already held: not submitted again
    assert flow.engine.num_unfinished == 0
    await flow.held.release(engine_key(admitted))


async def test_a_record_read_again_after_its_partition_was_taken_over_again_is_served() -> None:
    """Exactly-once drops a fenced partition's requests (cancelled in the engine, not yet
    ended) and, still the partition's owner, takes it over again and reads them again
    at once: each is served under the new assignment, and the dropped one's end is not
    taken for the new one's."""
    import dataclasses

    producer, finished, writer = _results()
    engine = Engine(FakeRuntime(), BatcherConfig())
    await engine.start()
    current = {TP: 1}  # the partition's assignment epoch, as the offset tracker keeps it

    def holds(tp: object, epoch: int) -> bool:
        return current.get(tp) == epoch

    held = HeldRequests()
    pump = EventPump(writer, held, engine, holds=holds)
    pumping = asyncio.create_task(pump.run())
    router = Router(writer, held, lambda: engine, lambda: None, owns=holds, holds=holds)
    try:
        admitted = _admitted(7)
        first = dataclasses.replace(
            admitted, epoch=1, request=admitted.request.model_copy(update={"max_tokens": 50}))
        await router.route(first)
        # Fenced: revoked, its held requests cancelled; then taken over again and read
        # again before the engine has ended the cancelled one (no await in between).
        current[TP] = 2
        assert held.cancel_from({TP}, engine) == 1
        await router.route(dataclasses.replace(first, epoch=2))
        assert await held.wait_empty(10)
        assert await pump.wait_idle(engine)
        await writer.flush()
        terminal = [e for e in _events(producer) if e["type"] != "token"]
        assert [(e["request_id"], e["type"]) for e in terminal] == [("r-7", "done")]
        assert finished == [7]
    finally:
        pumping.cancel()
        await engine.stop()


async def test_waits_end_on_events_or_time_out(flow) -> None:
    held = flow.held
    held.hold("k", type("Ctx", (), {"topic_partition": TP})())  # type: ignore[arg-type]
    assert not await held.wait_empty(0.05)
    assert not await held.wait_none_from({TP}, 0.05)
    assert await held.wait_none_from({TopicPartition("other", 0)}, 0.05)
    waiting = asyncio.create_task(held.wait_empty(10))
    await asyncio.sleep(0)
    await held.release("k")
    assert await asyncio.wait_for(waiting, 1)


async def test_sampling_left_out_comes_from_the_models_generation_config() -> None:
    from gpu_runtime import SamplingDefaults

    submitted = []

    class RecordingEngine:
        def submit(self, request) -> None:
            submitted.append(request.params)

    producer = FakeProducer(topics={"replies"})
    writer = ResultWriter(ResultsOptions("tiny", "t", "d", {}, 1.0), lambda tp, o: None,
                          producer=producer)
    router = Router(writer, HeldRequests(), lambda: RecordingEngine(), lambda: None,
                    lambda: SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20))
    base = dict(model="tiny", prompt_token_ids=[1, 2], reply_topic="replies")
    for offset, fields in enumerate(({}, {"temperature": 0.0, "top_k": 5})):
        request = InferenceRequest(request_id=f"s-{offset}", **base, **fields)
        await router.route(Admitted(request, TP, offset, 0, "replies", time.time(), 60_000,
                                    [1, 2]))
    left_out, given = submitted
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.9, 20)
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.9, 5)


def test_who_decides_whether_a_worker_compiles(monkeypatch):
    """--compile/--no-compile, else SLUICE_COMPILE, else the compute config, else auto
    (on for CPU, off on CUDA)."""
    from common.settings import Settings
    from schemas import ModelDeployment
    from worker.options import WorkerOptions

    def dep(compile: bool | None) -> ModelDeployment:
        return ModelDeployment(model="tiny", revision=1, path="/m",
                               compute_config={"compile": compile})

    cpu, gpu = WorkerOptions(model="tiny"), WorkerOptions(model="tiny", device="cuda")
    assert cpu.runtime_config(dep(None)).compile is False  # measured: not worth its cost
    assert gpu.runtime_config(dep(None)).compile is False
    assert cpu.runtime_config(dep(True)).compile is True
    assert gpu.runtime_config(dep(True)).compile is True
    assert cpu.runtime_config(dep(False)).compile is False
    assert cpu.runtime_config(dep(True), host_compile=False).compile is False
    assert gpu.runtime_config(dep(False), host_compile=True).compile is True
    flagged = WorkerOptions(model="tiny", compile=False)
    assert flagged.runtime_config(dep(True), host_compile=True).compile is False
    monkeypatch.setenv("SLUICE_COMPILE", "1")
    assert Settings().compile is True
    monkeypatch.setenv("SLUICE_COMPILE", "")
    assert Settings().compile is None
