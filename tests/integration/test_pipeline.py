"""Requests in on Kafka, tokens out on Kafka: a worker process, the SDK, the real broker/DB."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

import sluice
from common.settings import Settings
from schemas import DeadLetterRecord, DoneEvent, TokenEvent, decode
from sluice.errors import RequestError, RequestTimeoutError
from tests.integration.pipeline_helpers import drop_schema, worker_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]



def _setup(settings: Settings, model_dir: Path, **compute: object) -> tuple[sluice.Client, str]:
    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(model_dir),
                           compute_config={"kv_cache_len": 4096, **compute})
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="tiny")
    return client, key


async def _read_until(settings: Settings, topic: str, found, timeout_s: float = 30) -> list:
    """Records of `topic` from the start, until `found(records)` holds."""
    consumer = AIOKafkaConsumer(topic, **settings.kafka_options(),
                                auto_offset_reset="earliest")
    await consumer.start()
    out: list = []
    try:
        async with asyncio.timeout(timeout_s):
            while not found(out):
                batch = await consumer.getmany(timeout_ms=500)
                out += [r for rs in batch.values() for r in rs]
    finally:
        await consumer.stop()
    return out


async def _committed_past(admin, group: str, record: DeadLetterRecord) -> None:
    """Wait until `group`'s commit point on the dead-lettered record's partition has
    moved past it: nothing stuck behind it."""
    async with asyncio.timeout(30):
        while True:
            offsets = await admin.list_consumer_group_offsets(group)
            committed = {tp.partition: o.offset for tp, o in offsets.items()}
            if committed.get(record.partition, -1) > record.offset:
                return
            await asyncio.sleep(0.5)


def _scrape(worker) -> str:
    import re
    import urllib.request

    worker.wait_for_log("metrics on port")
    port = int(re.search(r"metrics on port (\d+)", worker.log()).group(1))
    time.sleep(1.2)  # gauges refresh once a second
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


async def test_multi_turn_session_reuses_the_kv_cache(settings, tiny_model, tmp_path) -> None:
    client, key = _setup(settings, tiny_model)
    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            messages = [{"role": "system", "content": "You are a terse helper."},
                        {"role": "user", "content": "Tell me about the river."}]
            cached = []
            for turn in range(3):
                tokens: list[int] = []
                text = ""
                done = None
                async with asyncio.timeout(120):
                    async for event in client.stream(
                        model="tiny", api_key=key, session_id="chat-42", messages=messages,
                        max_tokens=12, request_id=f"turn-{turn}",
                    ):
                        if isinstance(event, TokenEvent):
                            tokens += event.token_ids
                            text += event.text
                        else:
                            done = event
                assert isinstance(done, DoneEvent), (done, worker.log())
                assert done.token_ids == tokens
                assert done.text == text
                assert done.usage.completion_tokens == len(tokens)
                cached.append(done.usage.cached_prompt_tokens)
                messages += [{"role": "assistant", "content": done.text},
                             {"role": "user", "content": f"And then, part {turn}?"}]
            assert cached[0] == 0
            assert cached[1] > 0 and cached[2] > cached[1], cached
            metrics = await asyncio.to_thread(_scrape, worker)
            assert 'sluice_requests_total{model="tiny",pool="default",type="done"} 3.0' in metrics
            assert "sluice_cached_prompt_tokens_total" in metrics
            assert "sluice_consumer_lag" in metrics and "sluice_kv_blocks_free" in metrics
    finally:
        await client.aclose()
        await drop_schema(settings)


async def test_bad_requests_get_clear_answers(settings, tiny_model, tmp_path) -> None:
    client, key = _setup(settings, tiny_model)
    other = client.keys.create(tenant="globex")
    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            ok = await asyncio.wait_for(client.complete(
                model="tiny", api_key=key, prompt="Hello there", max_tokens=4), 120)
            assert ok.finish_reason in ("stop", "length"), worker.log()

            async def code_of(**fields: object) -> str:
                with pytest.raises(RequestError) as info:
                    await asyncio.wait_for(client.complete(model="tiny", **fields), 60)
                return info.value.code

            assert await code_of(api_key=other, prompt="hi") == "unauthorized"
            assert await code_of(api_key="sk-sluice-nonsense", prompt="hi") == "unauthorized"
            assert await code_of(prompt="hi") == "unauthorized"
            assert await code_of(api_key=key, prompt="hi", adapter="ghost") == "unknown_adapter"
            assert await code_of(api_key=key, prompt_token_ids=[1, 999_999]) == "invalid_request"
            assert await code_of(api_key=key, prompt_token_ids=[5] * 3000) == "context_too_long"
            # The prompt fits, prompt + max_tokens does not: refused, never cut short.
            with pytest.raises(RequestError, match=r"1000 tokens and max_tokens=1500 make 2500"):
                await asyncio.wait_for(client.complete(
                    model="tiny", api_key=key, prompt_token_ids=[5] * 1000, max_tokens=1500), 60)

            # Malformed bytes go to the dead-letter topic; fields that parse but are
            # wrong get an `invalid_request` event on the reply topic.
            producer = AIOKafkaProducer(**settings.kafka_options())
            await producer.start()
            await producer.send_and_wait(settings.requests_topic("tiny"), b"\xff\xfe not json")
            bad_fields = {"v": 1, "request_id": "typed-wrong", "model": "tiny",
                          "prompt": "hi", "max_tokens": "many"}
            await producer.send_and_wait(settings.requests_topic("tiny"),
                                         orjson.dumps(bad_fields))
            await producer.stop()
            dead = await _read_until(settings, settings.topic("deadletter"), bool)
            record = decode(DeadLetterRecord, dead[0].value)
            assert record.value() == b"\xff\xfe not json" and "undecodable" in record.reason
            events = await _read_until(settings, settings.topic("results"), lambda rs: any(
                b"typed-wrong" in r.value for r in rs))
            answers = [orjson.loads(r.value) for r in events]
            typed = [a for a in answers if a["request_id"] == "typed-wrong"]
            assert typed and typed[0]["code"] == "invalid_request"
            assert "max_tokens" in typed[0]["message"]

            # The worker kept serving throughout.
            again = await asyncio.wait_for(client.complete(
                model="tiny", api_key=key, prompt="Still there?", max_tokens=3), 60)
            assert again.usage.completion_tokens >= 1
            assert worker.proc.poll() is None
            # Structured logs name requests; API keys appear in no log line.
            log = worker.log()
            assert '"request_id":"typed-wrong"' in log or "unauthorized" in log
            assert key not in log and key.split(".")[1] not in log and other not in log
    finally:
        await client.aclose()
        await drop_schema(settings)


async def test_a_terminal_the_reply_topic_refuses_dead_letters_the_request(
    settings, tiny_model, tmp_path
) -> None:
    """The reply topic takes no record as large as the `done` event (a broker-side
    refusal that no retry fixes): the request is dead-lettered with the reason,
    and its offset is committed past — nothing is lost, nothing is stuck."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from schemas import InferenceRequest

    client, key = _setup(settings, tiny_model)
    small = f"{settings.topic_prefix}.small-replies"
    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(small, 1, 1,
                                            topic_configs={"max.message.bytes": "200"})])
        with worker_process(settings, "tiny", tmp_path) as worker:
            refused = asyncio.create_task(client.complete(
                model="tiny", api_key=key, prompt="a long answer please", max_tokens=48,
                stream=False, reply_topic=small, request_id="too-big"))
            dead = await _read_until(settings, settings.topic("deadletter"), bool, 120)
            record = decode(DeadLetterRecord, dead[0].value)
            assert "could not be written to its reply topic" in record.reason, worker.log()
            assert small in record.reason and "MessageSizeTooLarge" in record.reason
            assert decode(InferenceRequest, record.value()).request_id == "too-big"
            assert record.topic == settings.requests_topic("tiny")
            refused.cancel()

            after = await asyncio.wait_for(client.complete(
                model="tiny", api_key=key, prompt="and a normal one", max_tokens=3), 60)
            assert after.usage.completion_tokens >= 1
            await _committed_past(admin, settings.topic("tiny"), record)
            assert worker.proc.poll() is None
    finally:
        await admin.close()
        await client.aclose()
        await drop_schema(settings)


async def test_a_reply_topic_deleted_mid_request_dead_letters_it(
    settings, tiny_model, tmp_path, monkeypatch
) -> None:
    """The reply topic is deleted after the worker has checked it: the terminal event
    has nowhere to go, so once the broker says (twice) that the topic is gone, the
    request is dead-lettered naming it, and the partition's commit point moves past —
    instead of retrying for ten request timeouts or staying unfinished. Requests to the
    gone topic never hold up other requests' events (the writer is sequential, and
    waiting for the topic's metadata could take a whole request timeout, 30 s here)."""

    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from schemas import InferenceRequest, encode

    monkeypatch.setenv("SLUICE_CLIENT__TIMEOUT_SECS", "30")  # the worker's request timeout
    client, key = _setup(settings, tiny_model)
    doomed = f"{settings.topic_prefix}.doomed-replies"
    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    producer = AIOKafkaProducer(**settings.kafka_options())
    await producer.start()

    async def orphan(request_id: str) -> None:
        request = InferenceRequest(request_id=request_id, model="tiny", prompt="hi again",
                                   max_tokens=3, reply_topic=doomed)
        await producer.send_and_wait(
            settings.requests_topic("tiny"), encode(request), key=request.partition_key.encode(),
            headers=[("authorization", f"Bearer {key}".encode())])

    def dead_ids(records) -> set[str]:
        return {decode(InferenceRequest, decode(DeadLetterRecord, r.value).value()).request_id
                for r in records}

    try:
        await admin.create_topics([NewTopic(doomed, 1, 1)])
        with worker_process(settings, "tiny", tmp_path) as worker:
            first = await asyncio.wait_for(client.complete(
                model="tiny", api_key=key, prompt="hello", max_tokens=3, reply_topic=doomed,
                request_id="before"), 120)  # the worker has now seen the topic exist
            assert first.usage.completion_tokens >= 1
            await admin.delete_topics([doomed])
            async with asyncio.timeout(30):
                while doomed in await admin.list_topics():
                    await asyncio.sleep(0.2)
            await orphan("orphan-1")  # its events go out on the topic's cached metadata
            dead = await _read_until(settings, settings.topic("deadletter"), bool, 120)
            record = decode(DeadLetterRecord, dead[0].value)
            assert dead_ids(dead) == {"orphan-1"}, worker.log()
            assert doomed in record.reason and "no longer exists" in record.reason
            await _committed_past(admin, settings.topic("tiny"), record)

            await orphan("orphan-2")  # now the producer has no metadata for the topic
            for i in range(3):
                started = time.monotonic()
                healthy = await asyncio.wait_for(client.complete(
                    model="tiny", api_key=key, prompt=f"still here {i}", max_tokens=3), 60)
                assert healthy.usage.completion_tokens >= 1
                assert time.monotonic() - started < 15, worker.log()
            dead = await _read_until(settings, settings.topic("deadletter"),
                                     lambda rs: len(rs) >= 2, 120)
            assert dead_ids(dead) == {"orphan-1", "orphan-2"}
            assert worker.proc.poll() is None
    finally:
        await producer.stop()
        await admin.close()
        await client.aclose()
        await drop_schema(settings)


async def test_request_expired_before_any_worker_times_out(settings, tiny_model,
                                                           tmp_path) -> None:
    client, key = _setup(settings, tiny_model)
    try:
        pending = asyncio.create_task(client.complete(
            model="tiny", api_key=key, prompt="too late", max_tokens=4, max_ttft_ms=500,
            request_id="late-1"))
        await asyncio.sleep(1.5)  # no worker yet: the deadline passes in the queue
        with worker_process(settings, "tiny", tmp_path):
            with pytest.raises(RequestTimeoutError) as info:
                await asyncio.wait_for(pending, 120)
            assert info.value.waited_ms >= 500
            records = await _read_until(settings, settings.topic("timeouts"), bool)
            record = orjson.loads(records[0].value)
            assert record["request_id"] == "late-1"
            assert record["request"]["prompt"] == "too late"
    finally:
        await client.aclose()
        await drop_schema(settings)


def test_batch_job_is_resumable_without_duplicates(settings, tiny_model, tmp_path) -> None:
    import signal
    import subprocess
    import sys

    from tests.integration.pipeline_helpers import settings_env

    client, key = _setup(settings, tiny_model)
    client.close()
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": f"job-{i}", "body": {"prompt": f"Item number {i}:",
                                                 "max_tokens": 3 + i % 4}} for i in range(500)]
    lines.append({"custom_id": "bad-1", "body": {"prompt": "x", "max_tokens": -1}})
    in_path.write_bytes(b"\n".join(orjson.dumps(line) for line in lines) + b"\n")
    env = {**settings_env(settings), "SLUICE_API_KEY": key}
    cmd = [sys.executable, "-m", "sluice", "batch", str(in_path), "--model", "tiny",
           "-o", str(out_path)]
    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            # The interrupted run keeps 4 lines in flight, so the 400 after the first 100
            # take 100 round trips through the broker: far longer than one poll here,
            # however fast the machine (with the auto window a fast one finished all 501
            # between two polls). The re-run below uses the default window.
            first = subprocess.Popen([*cmd, "--concurrency", "4"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                written = out_path.read_bytes().count(b"\n") if out_path.exists() else 0
                if written >= 100:
                    break
                assert first.poll() is None, first.stdout.read().decode()  # type: ignore[union-attr]
                time.sleep(0.02)
            first.send_signal(signal.SIGKILL)
            first.wait()
            partial = out_path.read_bytes().count(b"\n")
            assert 100 <= partial < 501, partial

            second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            # bad-1 fails again: the job says so with its exit code.
            assert second.returncode == 1, second.stdout + second.stderr + worker.log()
            assert "skipped" in second.stdout and "tokens/s" in second.stdout
            assert "1 errors" in second.stdout and "a re-run retries them" in second.stderr
    finally:
        asyncio.run(drop_schema(settings))
    outputs = [orjson.loads(raw) for raw in out_path.read_bytes().splitlines() if raw.strip()]
    ids = [o["custom_id"] for o in outputs]
    assert len(ids) == len(set(ids)) == 501
    by_id = {o["custom_id"]: o for o in outputs}
    assert by_id["bad-1"]["error"]["code"] == "invalid_request"
    assert all(by_id[f"job-{i}"]["response"]["type"] == "done" for i in range(500))


def test_batch_rerun_retries_failed_lines(settings, tiny_model, tmp_path) -> None:
    """A first run with a key not yet granted fails every line (exit 1); after the
    grant, a re-run retries exactly those lines and replaces their error lines;
    --keep-errors keeps an error line as it is."""
    import subprocess
    import sys

    from tests.integration.pipeline_helpers import settings_env

    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(tiny_model),
                           compute_config={"kv_cache_len": 4096})
    key = client.keys.create(tenant="acme")
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": f"job-{i}", "body": {"prompt": f"Item {i}", "max_tokens": 3}}
             for i in range(4)]
    in_path.write_bytes(b"\n".join(orjson.dumps(line) for line in lines) + b"\n")
    env = {**settings_env(settings), "SLUICE_API_KEY": key}
    cmd = [sys.executable, "-m", "sluice", "batch", str(in_path), "--model", "tiny",
           "-o", str(out_path)]

    def outputs() -> dict[str, list[dict]]:
        by_id: dict[str, list[dict]] = {}
        for raw in out_path.read_bytes().splitlines():
            line = orjson.loads(raw)
            by_id.setdefault(line["custom_id"], []).append(line)
        return by_id

    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            assert first.returncode == 1, first.stdout + first.stderr + worker.log()
            assert "0 done, 4 errors" in first.stdout
            assert all(ls[0]["error"]["code"] == "unauthorized" for ls in outputs().values())

            client.keys.grant(key, model="tiny")
            time.sleep(1.5)  # the workers' permission caches hear of it (LISTEN/NOTIFY)
            second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            assert second.returncode == 0, second.stdout + second.stderr + worker.log()
            assert "4 done, 0 errors, 0 skipped (already answered), 4 retried" in second.stdout
            by_id = outputs()
            assert sorted(by_id) == [f"job-{i}" for i in range(4)]
            assert all(len(ls) == 1 and ls[0]["response"]["type"] == "done"
                       for ls in by_id.values())

            with in_path.open("ab") as src:
                src.write(orjson.dumps({"custom_id": "bad", "body": {"max_tokens": 2}}) + b"\n")
            third = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            assert third.returncode == 1 and "4 skipped" in third.stdout, third.stdout
            kept = subprocess.run([*cmd, "--keep-errors"], env=env, capture_output=True,
                                  text=True, timeout=300)
            assert kept.returncode == 1, kept.stdout + kept.stderr
            assert "0 done, 0 errors, 4 skipped (already answered), 1 earlier errors kept" \
                in kept.stdout
            assert len(outputs()["bad"]) == 1
            assert outputs()["bad"][0]["error"]["code"] == "invalid_request"
    finally:
        client.close()
        asyncio.run(drop_schema(settings))


def test_chat_cli_holds_a_conversation(settings, tiny_model, tmp_path) -> None:
    import subprocess
    import sys

    from tests.integration.pipeline_helpers import settings_env

    client, key = _setup(settings, tiny_model)
    client.close()
    env = {**settings_env(settings), "SLUICE_API_KEY": key, "COLUMNS": "200"}
    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            result = subprocess.run(
                [sys.executable, "-m", "sluice", "chat", "--model", "tiny", "--session", "c-1",
                 "--max-tokens", "8"],
                input="Hello river\nAnd after that?\n/exit\n", env=env, capture_output=True,
                text=True, timeout=120,
            )
            assert result.returncode == 0, result.stdout + result.stderr + worker.log()
    finally:
        asyncio.run(drop_schema(settings))
    summaries = [line for line in result.stdout.splitlines() if "prompt tokens cached" in line]
    assert len(summaries) == 2, result.stdout
    assert " 0 prompt tokens cached" in summaries[0]
    assert " 0 prompt tokens cached" not in summaries[1]  # turn 2 reuses turn 1's KV


async def test_tenant_reply_topic_prefix_is_enforced(settings, tiny_model, tmp_path) -> None:
    from common.topics import TopicAdmin, TopicSpec

    client, _ = _setup(settings, tiny_model)
    key = client.keys.create(tenant="acme", reply_topic_prefix=f"{settings.topic_prefix}-acme.")
    client.keys.grant(key, model="tiny")
    own = f"{settings.topic_prefix}-acme.replies"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(own, 2, {})])
    try:
        with worker_process(settings, "tiny", tmp_path):
            done = await asyncio.wait_for(client.complete(
                model="tiny", api_key=key, prompt="mine", max_tokens=2, reply_topic=own), 120)
            assert done.usage.completion_tokens >= 1
            # The shared results topic is off limits for this tenant's key.
            stray = asyncio.create_task(client.complete(
                model="tiny", api_key=key, prompt="theirs", max_tokens=2, request_id="stray-1"))
            dead = await _read_until(settings, settings.topic("deadletter"), lambda rs: any(
                b"stray-1" in decode(DeadLetterRecord, r.value).value() for r in rs))
            reasons = [decode(DeadLetterRecord, r.value).reason for r in dead]
            assert any("may only use reply topics starting with" in r for r in reasons)
            assert not stray.done()
            stray.cancel()
    finally:
        await client.aclose()
        await drop_schema(settings)


async def test_adapters_through_kafka_match_the_runtime_alone(settings, tiny_model,
                                                              tmp_path) -> None:
    from gpu_runtime import Runtime, RuntimeConfig, SamplingParams, StepPlan
    from gpu_runtime.tiny import make_tiny_adapters

    adapters = make_tiny_adapters(tiny_model, tmp_path / "adapters", 3)
    client, key = _setup(settings, tiny_model)
    for i, path in enumerate(adapters):
        client.adapters.register(model="tiny", name=f"a{i}", path=str(path))
        if i < 2:
            client.keys.grant(key, model="tiny", adapter=f"a{i}")
    prompt = [5, 17, 33, 42, 8, 99]
    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            names = [None, "a0", "a1", None, "a0", "a1"]
            results = await asyncio.wait_for(asyncio.gather(*(
                client.complete(model="tiny", api_key=key, adapter=name, max_tokens=12,
                                prompt_token_ids=prompt) for name in names)), 120)
            with pytest.raises(RequestError) as info:  # a2 exists but is not granted
                await asyncio.wait_for(client.complete(
                    model="tiny", api_key=key, adapter="a2", prompt_token_ids=prompt), 60)
            assert info.value.code == "unauthorized", worker.log()
    finally:
        await client.aclose()
        await drop_schema(settings)

    rt = Runtime(tiny_model, RuntimeConfig(kv_cache_len=2048))
    for i, path in enumerate(adapters):
        rt.register_adapter(f"a{i}", path)

    def alone(adapter: str | None) -> list[int]:
        rt.add_sequence("x", prompt, SamplingParams(max_tokens=12), adapter)
        out: list[int] = []
        while "x" in rt.sequences:
            step = rt.execute(StepPlan({"x": rt.sequences["x"].num_uncomputed}))
            out += [o.token_id for o in step.outputs]
        return out

    expected = {name: alone(name) for name in (None, "a0", "a1")}
    assert len({tuple(v) for v in expected.values()}) == 3  # adapters change the output
    for name, done in zip(names, results, strict=True):
        assert done.token_ids == expected[name], name
        assert done.adapter == name


async def test_a_compiled_worker_answers_as_the_eager_runtime(settings, tiny_model,
                                                              tmp_path) -> None:
    """compute_config compile=True (the suite's SLUICE_COMPILE=0 cleared): the worker
    serves at once with eager steps, builds the compiled step behind, says so in its
    log and heartbeat, and its answers before and after equal the eager runtime's."""
    from gpu_runtime import Runtime, RuntimeConfig, SamplingParams, StepPlan

    client, key = _setup(settings, tiny_model, compile=True)
    prompts = [[5, 17, 33, 42, 8, 99], [7] * 20, list(range(3, 40)), [11, 12]]

    async def answers() -> list[DoneEvent]:
        return await asyncio.wait_for(asyncio.gather(*(
            client.complete(model="tiny", api_key=key, max_tokens=24, prompt_token_ids=p)
            for p in prompts)), 180)

    try:
        with worker_process(settings, "tiny", tmp_path, env={"SLUICE_COMPILE": ""}) as worker:
            first = await answers()  # the first answers do not wait for the compiler
            worker.wait_for_log("compiled the decode step of tiny in", 300)
            log = worker.log_path.read_text(errors="replace")
            assert log.index("serving tiny as") < log.index("compiled the decode step")
            assert "eager steps" not in log
            statuses = {w.status for w in client.workers.list(model="tiny") if w.live}
            assert statuses == {"serving (compiled)"}, statuses
            results = await answers()
    finally:
        await client.aclose()
        await drop_schema(settings)

    rt = Runtime(tiny_model, RuntimeConfig(kv_cache_len=2048))
    for i, p in enumerate(prompts):
        rt.add_sequence(f"x{i}", p, SamplingParams(max_tokens=24))
    expected: dict[str, list[int]] = {s: [] for s in rt.sequences}
    while rt.sequences:
        step = rt.execute(StepPlan({s: q.num_uncomputed for s, q in rt.sequences.items()}))
        for o in step.outputs:
            expected[o.seq_id].append(o.token_id)
    for i, (done, before) in enumerate(zip(results, first, strict=True)):
        assert done.token_ids == before.token_ids == expected[f"x{i}"], i
