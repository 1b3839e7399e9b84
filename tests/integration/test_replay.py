"""`sluice replay`: yesterday's traffic of a model, re-run on an adapter, through the CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from datetime import UTC, datetime

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

import sluice
from common.settings import Settings
from schemas import DoneEvent, InferenceRequest, decode
from sluice.replay import (
    REPLAY_ID_PREFIX,
    Position,
    ReplayInputError,
    replay_id,
    replayed_fields,
)
from sluice.replay_source import parse_position
from tests.integration.pipeline_helpers import drop_schema, settings_env, worker_process

PROMPTS = [[5, 17, 33, 42, 8, 99], [7] * 12, list(range(3, 30)), [11, 12], [60, 61, 62, 63],
           [9, 80, 7, 70, 6]]


def test_positions_parse_as_documented() -> None:
    now = 1_716_544_800_000
    assert parse_position("earliest") == Position(earliest=True)
    assert parse_position("0:120,3:7") == Position(offsets={0: 120, 3: 7})
    assert parse_position("1716544800000") == Position(time_ms=now)
    assert parse_position("2024-05-24T10:00:00Z") == Position(time_ms=now)
    assert parse_position("2024-05-24T12:00:00+02:00") == Position(time_ms=now)
    assert parse_position("-24h", now_ms=now) == Position(time_ms=now - 86_400_000)
    assert parse_position("-1.5m", now_ms=now) == Position(time_ms=now - 90_000)
    for bad in ("yesterday", "0:1,0:2", "5:", "-3w"):
        with pytest.raises(ReplayInputError):
            parse_position(bad)


def test_replayed_requests_keep_what_the_producer_set() -> None:
    original = InferenceRequest(
        request_id="r-1", session_id="chat-9", model="tiny", adapter="old", prompt="hi",
        max_tokens=5, top_k=3, stop=["x"], seed=4, max_ttft_ms=200, reply_topic="mine",
        metadata={"k": 1})
    fields = replayed_fields(original, "new")
    assert fields == {"session_id": "chat-9", "adapter": "new", "prompt": "hi", "max_tokens": 5,
                      "top_k": 3, "stop": ["x"], "seed": 4, "metadata": {"k": 1},
                      "max_ttft_ms": 24 * 3600 * 1000}
    # Sampling left out stays left out: the model's own defaults apply, as they did.
    assert "temperature" not in fields and "top_p" not in fields
    one = replay_id("t", 0, 5, "tiny", "a0")
    assert one.startswith(REPLAY_ID_PREFIX) and one == replay_id("t", 0, 5, "tiny", "a0")
    assert len({one, replay_id("t", 0, 5, "tiny", None), replay_id("t", 1, 5, "tiny", "a0"),
                replay_id("t", 0, 6, "tiny", "a0"), replay_id("t", 0, 5, "big", "a0")}) == 5


async def _send_originals(settings: Settings, key: str) -> tuple[str, dict[str, DoneEvent]]:
    """One request before the replay's --from time (returned), six after it to the base
    model through the SDK, then a cancel record and a record that is no request."""
    client = sluice.Client(settings)
    try:
        await client.check_model("tiny")  # one producer, before the requests race to start it
        await client.complete(model="tiny", api_key=key, request_id="early", max_tokens=2,
                              prompt_token_ids=[1, 2], timeout=60)
        await asyncio.sleep(0.05)
        since = datetime.fromtimestamp(time.time(), UTC).isoformat()
        await asyncio.sleep(0.05)
        dones = await asyncio.wait_for(asyncio.gather(*(
            client.complete(model="tiny", api_key=key, request_id=f"orig-{i}", max_tokens=8,
                            prompt_token_ids=prompt, session_id=f"s-{i % 2}")
            for i, prompt in enumerate(PROMPTS))), 120)
    finally:
        await client.aclose()
    producer = AIOKafkaProducer(**settings.producer_options())
    await producer.start()
    try:
        auth = [("authorization", f"Bearer {key}".encode())]
        topic = settings.requests_topic("tiny")
        await producer.send_and_wait(topic, b'{"v":1,"type":"cancel","request_id":"orig-0"}',
                                     key=b"s-0", headers=auth)
        await producer.send_and_wait(topic, b"not a request", key=b"junk", headers=auth)
    finally:
        await producer.stop()
    return since, {d.request_id: d for d in dones}


async def _replay_records(settings: Settings, expected: int) -> list:
    """The replayed requests the runs put on the model's own request topic."""
    consumer = AIOKafkaConsumer(settings.requests_topic("tiny"), **settings.kafka_options(),
                                auto_offset_reset="earliest")
    await consumer.start()
    records: list = []
    try:
        async with asyncio.timeout(30):
            while len(records) < expected:
                batch = await consumer.getmany(timeout_ms=500)
                records += [r for rs in batch.values() for r in rs]
    finally:
        await consumer.stop()
    return [r for r in records if r.value.startswith(b"{") and b'"replay-' in r.value]


@pytest.mark.integration
@pytest.mark.slow
def test_replay_onto_an_adapter_pairs_each_original_and_resumes(settings, tiny_model,
                                                                 tmp_path) -> None:
    from gpu_runtime.tiny import make_tiny_adapters

    (adapter,) = make_tiny_adapters(tiny_model, tmp_path / "adapters", 1)
    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(tiny_model),
                           compute_config={"kv_cache_len": 4096})
    client.adapters.register(model="tiny", name="a0", path=str(adapter))
    original_key = client.keys.create(tenant="acme")
    client.keys.grant(original_key, model="tiny")
    client.keys.grant(original_key, model="tiny", adapter="a0")
    replayer_key = client.keys.create(tenant="replayer")
    client.keys.grant(replayer_key, model="tiny")  # not the adapter, yet
    out_path = tmp_path / "out.jsonl"
    env = {**settings_env(settings), "SLUICE_API_KEY": replayer_key}

    def run() -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "sluice", "replay", "--model", "tiny", "--from", since,
               "--adapter", "a0", "--original-replies", settings.topic("results"),
               "--concurrency", "4", "-o", str(out_path)]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            since, originals = asyncio.run(_send_originals(settings, original_key))

            # The replayer's own key may not use a0: every replay is refused (exit 1).
            first = run()
            assert first.returncode == 1, first.stdout + first.stderr + worker.log()
            assert "6 replayed (0 done, 6 errors), 2 skipped (1 cancels, 1 invalid, " \
                   "0 replays)" in first.stdout, first.stdout
            errors = [orjson.loads(raw) for raw in out_path.read_bytes().splitlines()]
            assert [e["error"]["code"] for e in errors] == ["unauthorized"] * 6

            client.keys.grant(replayer_key, model="tiny", adapter="a0")
            time.sleep(1.5)  # the worker's permission cache hears of it (LISTEN/NOTIFY)
            second = run()
            assert second.returncode == 0, second.stdout + second.stderr + worker.log()
            assert "6 replayed (6 done, 0 errors), 8 skipped (1 cancels, 1 invalid, " \
                   "6 replays), 0 already answered, 6 retried" in second.stdout, second.stdout
            after_second = out_path.read_bytes()

            third = run()  # nothing left: the 12 replays of runs 1-2 are skipped too
            assert third.returncode == 0, third.stdout + third.stderr
            assert "0 replayed (0 done, 0 errors), 14 skipped (1 cancels, 1 invalid, " \
                   "12 replays), 6 already answered of 20 records" in third.stdout, third.stdout
            assert out_path.read_bytes() == after_second
            replays = asyncio.run(_replay_records(settings, 21))
    finally:
        client.close()
        asyncio.run(drop_schema(settings))

    lines = [orjson.loads(raw) for raw in after_second.splitlines()]
    # One line per original after --from ("early" came before it).
    assert sorted(line["request_id"] for line in lines) == sorted(originals)
    changed = 0
    for line in lines:
        original, new = originals[line["request_id"]], line["response"]
        assert line["error"] is None and new["type"] == "done"
        assert new["adapter"] == "a0" and new["request_id"] == line["replay_request_id"]
        assert line["original"] == original.model_dump(mode="json")
        assert line["changed"] == (new["token_ids"] != original.token_ids
                                   or new["text"] != original.text)
        changed += line["changed"]
    assert changed >= 1  # the adapter changes greedy answers
    assert f"vs originals: {changed} changed, {6 - changed} same, 0 originals not found" \
        in second.stdout

    # What was sent: the originals' fields, a new id, the adapter, the replayer's key.
    assert len(replays) == 12  # two runs of six, with the same ids
    sent = {decode(InferenceRequest, r.value).request_id: r for r in replays}
    for line in lines:
        record = sent[line["replay_request_id"]]
        request = decode(InferenceRequest, record.value)
        i = int(line["request_id"].removeprefix("orig-"))
        assert request.prompt_token_ids == PROMPTS[i] and request.max_tokens == 8
        assert request.session_id == f"s-{i % 2}" and request.adapter == "a0"
        assert dict(record.headers)["authorization"] == f"Bearer {replayer_key}".encode()
    # The original key is never stored or printed.
    for text in (after_second.decode(), first.stdout + first.stderr,
                 second.stdout + second.stderr, third.stdout + third.stderr):
        assert original_key not in text
