"""Zombie fencing at the broker: a partition's transactional id, taken over by its new
owner, fences the old one for good.

Two owners of one input partition, as a paused worker and the one the group gave its
partition to: the old one has an answer in its open transaction when the new one takes
the partition over. The broker aborts that transaction, and the old owner can commit
neither it nor offsets afterwards (its committer reports the partition lost); a
`read_committed` reader never sees its answer, and the committed offset is the new
owner's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from common.topics import TopicAdmin, TopicSpec, committed_of
from results.producer import TransactionsFailed
from results.transactions import PartitionTransactions, TransactionCommitter

pytestmark = [pytest.mark.integration]


async def test_a_taken_over_partition_fences_its_old_owner(settings) -> None:
    inputs, replies = f"{settings.topic_prefix}.requests.m", f"{settings.topic_prefix}.replies"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(inputs, 1, {}), TopicSpec(replies, 1, {})])
    group = f"{settings.topic_prefix}.m"
    tp = TopicPartition(inputs, 0)
    options, lost = settings.producer_options(), []
    offsets = {"old": (5, "h=5;a=0"), "new": (3, "h=4;a=1")}

    def committer(txns: PartitionTransactions, who: str) -> TransactionCommitter:
        return TransactionCommitter(txns, lambda: {tp: offsets[who]}, lambda _c: None,
                                    on_lost=lambda t, why: lost.append((who, t, why)))

    old, new = (PartitionTransactions(options, 30, group) for _ in range(2))
    try:
        await old.open([tp])
        await (await old.port(tp).send(replies, orjson.dumps({"by": "old", "n": 1}), b"k"))
        await new.open([tp])  # the new owner takes the partition over
        zombie = committer(old, "old")
        # The zombie wakes and commits, from two tasks at once as a worker does (its
        # commit loop and the committer's own): the one that finds the partition fenced
        # reports it; the other, and any later commit, must not take the same fencing
        # for a failure of the worker (it stopped whole workers: exit code 3).
        await asyncio.gather(zombie.commit(), zombie.commit())
        await zombie.commit()
        assert [(who, t) for who, t, _ in lost] == [("old", tp)]
        assert "taken over by another worker" in lost[0][2]
        await (await new.port(tp).send(replies, orjson.dumps({"by": "new", "n": 2}), b"k"))
        await committer(new, "new").commit()
        assert len(lost) == 1

        async with _committed_reader(settings, replies) as reader:
            seen = []
            async with asyncio.timeout(30):
                while not seen:
                    batch = await reader.getmany(timeout_ms=500)
                    seen += [orjson.loads(r.value)["by"] for rs in batch.values() for r in rs]
            assert seen == ["new"]  # the old owner's answer was aborted
            assert await committed_of(reader, group, inputs, 0) == offsets["new"]
    finally:
        await old.close_all()
        await new.close_all()
        async with TopicAdmin(settings) as admin:
            await admin.delete([inputs, replies])


async def test_a_partition_let_go_of_mid_commit_commits_no_answer(settings) -> None:
    """A commit waits for its answers' acknowledgements when the partition is let go of
    (its group membership lost, say): its commit point is gone with it, so committing
    would commit the answers without their offsets, and the partition's next owner
    would answer them again. Nothing of it is committed; its next owner's take-over
    aborts the transaction."""
    inputs, replies = f"{settings.topic_prefix}.requests.l", f"{settings.topic_prefix}.replies-l"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(inputs, 1, {}), TopicSpec(replies, 1, {})])
    group = f"{settings.topic_prefix}.l"
    tp = TopicPartition(inputs, 0)
    held = {tp: (7, "h=7;a=0")}  # the worker's commit point, until it lets go
    txns, successor = (PartitionTransactions(settings.producer_options(), 30, group)
                       for _ in range(2))
    committer = TransactionCommitter(txns, lambda: dict(held), lambda _c: None)
    try:
        await txns.open([tp])
        await txns.port(tp).send(replies, orjson.dumps({"by": "old"}), b"k")  # not acked yet
        commit = asyncio.create_task(committer.commit())
        for _ in range(3):  # into the commit, waiting for the acknowledgement
            await asyncio.sleep(0)
        assert not commit.done()
        held.clear()
        stopping = txns.release([tp])
        await commit
        await stopping
        await successor.open([tp])  # the next owner takes the partition over

        await _nothing_committed(settings, replies, group, inputs)  # no answer, no offset
    finally:
        await txns.close_all()
        await successor.close_all()
        async with TopicAdmin(settings) as admin:
            await admin.delete([inputs, replies])


async def test_a_commit_whose_partition_is_let_go_of_ends_at_once(settings) -> None:
    """A partition let go of while its commit's offsets are on their way (its group
    membership lost, a fence reported): its producer is stopped, and aiokafka's sender
    ends between the two requests that commit them, leaving the commit's wait unset for
    ever (a coordinator that does not answer does the same). The commit ends at once
    instead — before, it waited for good, and with it every later commit of the worker
    (`sluice bench chaos`: a worker's transactions all timed out, for minutes)."""
    inputs, replies = f"{settings.topic_prefix}.requests.g", f"{settings.topic_prefix}.replies-g"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(inputs, 1, {}), TopicSpec(replies, 1, {})])
    group = f"{settings.topic_prefix}.g"
    tp = TopicPartition(inputs, 0)
    txns = PartitionTransactions(settings.producer_options(), 30, group)
    reports: list[str] = []
    committer = TransactionCommitter(txns, lambda: {tp: (3, "h=3;a=0")}, lambda _c: None,
                                     on_lost=lambda _t, why: reports.append(why),
                                     on_failed=lambda _t, why: reports.append(why))
    try:
        await txns.open([tp])
        port = txns.port(tp)
        await (await port.send(replies, orjson.dumps({"by": "old"}), b"k"))
        commit = asyncio.create_task(committer.commit())
        async with asyncio.timeout(10):  # into the offsets' commit, before its answer
            while not port.producer._txn_manager._pending_txn_offsets:
                await asyncio.sleep(0)
        stopping = asyncio.create_task(txns.release([tp]))  # as a worker lets go
        async with asyncio.timeout(5):
            await commit
        await stopping
        assert reports == []  # let go of: neither lost nor failed
    finally:
        await txns.close_all()
        async with TopicAdmin(settings) as admin:
            await admin.delete([inputs, replies])


async def test_a_commit_unanswered_in_time_drops_only_its_partition(settings) -> None:
    """A commit with no answer within its bound (here a bound of 0 s, so the commit is
    given up on before it asks anything) can no longer succeed: its partition is
    reported failed — the worker drops it and takes it over anew — its port refuses
    further records, and the take-over aborts the open transaction: its record is
    never committed."""
    inputs, replies = f"{settings.topic_prefix}.requests.u", f"{settings.topic_prefix}.replies-u"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(inputs, 1, {}), TopicSpec(replies, 1, {})])
    group = f"{settings.topic_prefix}.u"
    tp = TopicPartition(inputs, 0)
    txns, successor = (PartitionTransactions(settings.producer_options(), 30, group)
                       for _ in range(2))
    failed: list[tuple[object, str]] = []
    committer = TransactionCommitter(txns, lambda: {tp: (4, "h=4;a=0")}, lambda _c: None,
                                     on_failed=lambda t, why: failed.append((t, why)),
                                     commit_within_s=0.0)
    try:
        await txns.open([tp])
        await txns.port(tp).send(replies, orjson.dumps({"by": "old"}), b"k")
        await committer.commit()
        assert [t for t, _ in failed] == [tp] and "no answer in 0 s" in failed[0][1]
        with pytest.raises(TransactionsFailed):  # nothing more goes into it
            await txns.port(tp).send(replies, orjson.dumps({"by": "old"}), b"k")
        await txns.release([tp])
        await successor.open([tp])  # taken over anew: what was left open is aborted

        await _nothing_committed(settings, replies, group, inputs)
    finally:
        await txns.close_all()
        await successor.close_all()
        async with TopicAdmin(settings) as admin:
            await admin.delete([inputs, replies])


async def test_a_commit_that_waits_holds_back_no_other_partition(settings) -> None:
    """The background commits go on without a partition whose commit waits (on its
    coordinator, say; here its gate is held, as that commit holds it): another
    partition's answers are committed meanwhile, round after round. Before, every
    round waited for all of its commits, and one that waited held back every other
    partition's transactions until the coordinator aborted them."""
    inputs, replies = f"{settings.topic_prefix}.requests.h", f"{settings.topic_prefix}.replies-h"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(inputs, 2, {}), TopicSpec(replies, 1, {})])
    group = f"{settings.topic_prefix}.h"
    slow, fast = TopicPartition(inputs, 0), TopicPartition(inputs, 1)
    txns = PartitionTransactions(settings.producer_options(), 30, group)
    committer = TransactionCommitter(txns, lambda: {}, lambda _c: None)
    loop = asyncio.create_task(committer.run())
    try:
        await txns.open([slow, fast])
        await txns.port(slow).send(replies, orjson.dumps({"n": 0}), b"k")
        # The slow partition's commit waits (it holds the gate) all along.
        async with txns.port(slow).gate, _committed_reader(settings, replies) as reader:
            seen: list[int] = []
            for n in (1, 2, 3):  # one round after another
                await txns.port(fast).send(replies, orjson.dumps({"n": n}), b"k")
                async with asyncio.timeout(10):
                    while n not in seen:
                        batch = await reader.getmany(timeout_ms=200)
                        seen += [orjson.loads(r.value)["n"] for rs in batch.values() for r in rs]
            assert seen == [1, 2, 3]
        assert not loop.done()
    finally:
        loop.cancel()
        await txns.close_all()
        async with TopicAdmin(settings) as admin:
            await admin.delete([inputs, replies])


async def test_a_send_that_learns_its_partition_was_fenced_reports_it_at_once(settings) -> None:
    """A worker paused past its session got its partition back from the group while the
    other worker had taken the partition's transactional id over: its producer is
    fenced, and aiokafka refuses every later send. The send that learns of the fence
    reports the partition lost at once (the worker drops it and takes it over anew);
    before, only a commit of that partition did, and one waiting on a coordinator left
    its answers unfinished for 34 s (`sluice bench chaos`, seed 81: 53 timeouts)."""
    from aiokafka.errors import ProducerFenced

    inputs, replies = f"{settings.topic_prefix}.requests.s", f"{settings.topic_prefix}.replies-s"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(inputs, 1, {}), TopicSpec(replies, 1, {})])
    group = f"{settings.topic_prefix}.s"
    tp = TopicPartition(inputs, 0)
    old, new = (PartitionTransactions(settings.producer_options(), 30, group) for _ in range(2))
    lost: list[tuple[object, str]] = []
    zombie = TransactionCommitter(old, lambda: {}, lambda _c: None,
                                  on_lost=lambda t, why: lost.append((t, why)))
    try:
        await old.open([tp])
        await new.open([tp])  # the other worker takes the partition's id over
        port = old.port(tp)
        sent = await port.send(replies, orjson.dumps({"by": "old"}), b"k")
        with pytest.raises(ProducerFenced):
            await asyncio.wait_for(sent, 30)
        async with asyncio.timeout(5):  # no commit asked for
            while not lost:
                await asyncio.sleep(0.01)
        assert [t for t, _ in lost] == [tp] and "taken over by another worker" in lost[0][1]
        with pytest.raises(TransactionsFailed):  # refused at once from now on
            await port.send(replies, orjson.dumps({"by": "old"}), b"k")
        await zombie.commit()
        assert len(lost) == 1  # reported once
    finally:
        await old.close_all()
        await new.close_all()
        async with TopicAdmin(settings) as admin:
            await admin.delete([inputs, replies])


async def _nothing_committed(settings, replies: str, group: str, inputs: str) -> None:
    """No answer on `replies` for a `read_committed` reader, and no offset committed."""
    async with _committed_reader(settings, replies) as reader:
        batch = await reader.getmany(timeout_ms=3000)
        assert not [r for rs in batch.values() for r in rs]
        assert await committed_of(reader, group, inputs, 0) is None


@contextlib.asynccontextmanager
async def _committed_reader(settings, topic: str) -> AsyncIterator[AIOKafkaConsumer]:
    """A `read_committed` reader of `topic`'s partition 0, from its start."""
    reader = AIOKafkaConsumer(**settings.kafka_options(), isolation_level="read_committed",
                              auto_offset_reset="earliest", group_id=None)
    await reader.start()
    try:
        reader.assign([TopicPartition(topic, 0)])
        yield reader
    finally:
        await reader.stop()


async def test_two_take_overs_of_one_partition_share_one_producer(settings,
                                                                   monkeypatch) -> None:
    """Two rebalances in quick succession start a second take-over of a partition while
    the first still waits for its transactional id: two producers of one id in one
    worker fence each other, and the worker dropped as taken over by another worker a
    partition the group gave it (`sluice bench chaos`: a partition nobody served).
    Take-overs of a partition run one at a time and keep the producer already open; one
    whose partition was revoked meanwhile stops its producer."""
    from results import transactions as txn_module

    inputs, replies = f"{settings.topic_prefix}.requests.t", f"{settings.topic_prefix}.replies-t"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(inputs, 2, {}), TopicSpec(replies, 1, {})])
    group = f"{settings.topic_prefix}.t"
    tp, other = TopicPartition(inputs, 0), TopicPartition(inputs, 1)
    started: list[str] = []
    real_start = txn_module.TransactionalProducerPort.start

    async def counted_start(port) -> None:
        started.append(port.transactional_id)
        await real_start(port)

    monkeypatch.setattr(txn_module.TransactionalProducerPort, "start", counted_start)
    txns, lost = PartitionTransactions(settings.producer_options(), 30, group), []
    try:
        await asyncio.gather(txns.open([tp, other]), txns.open([tp]))
        assert started == [f"{group}.partition-0", f"{group}.partition-1"]
        committer = TransactionCommitter(txns, lambda: {tp: (1, "h=0;a=0")}, lambda _c: None,
                                         on_lost=lambda t, why: lost.append(t))
        await (await txns.port(tp).send(replies, orjson.dumps({"n": 1}), b"k"))
        await committer.commit()
        assert lost == []  # the one producer of the id was not fenced

        await txns.close_all()
        await txns.open([other], wanted=lambda _tp: False)  # revoked while taken over
        assert other not in txns.ports()
    finally:
        await txns.close_all()
        async with TopicAdmin(settings) as admin:
            await admin.delete([inputs, replies])


async def test_a_failed_transaction_drops_its_partition_not_the_worker(settings) -> None:
    """A transaction that fails other than by fencing (here the broker refuses a record
    too large for its topic; under faults, a coordinator cut off from its followers
    answers InvalidTxnState) is reported for its partition alone, which the worker
    takes over anew; it stopped the whole worker (exit code 3) before. Without that
    report, the failure still stops the committer."""
    inputs = f"{settings.topic_prefix}.requests.f"
    replies = f"{settings.topic_prefix}.replies-f"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(inputs, 2, {}),
                            TopicSpec(replies, 1, {"max.message.bytes": "2000"})])
    group = f"{settings.topic_prefix}.f"
    bad, good = TopicPartition(inputs, 0), TopicPartition(inputs, 1)
    failed: list[tuple[object, str]] = []
    txns = PartitionTransactions(settings.producer_options(), 30, group)
    try:
        await txns.open([bad, good])
        committer = TransactionCommitter(
            txns, lambda: {bad: (1, "h=0;a=0"), good: (1, "h=0;a=0")}, lambda _c: None,
            on_failed=lambda tp, why: failed.append((tp, why)))
        big = await txns.port(bad).send(replies, b"x" * 10_000, b"k")
        small = await txns.port(good).send(replies, orjson.dumps({"n": 1}), b"k")
        await committer.commit()  # does not raise
        assert [tp for tp, _ in failed] == [bad]
        assert "RecordTooLarge" in failed[0][1] or "MessageSizeTooLarge" in failed[0][1]
        assert big.done() and big.exception() is not None
        assert small.done() and small.exception() is None  # the other partition committed
        await committer.commit()
        assert len(failed) == 1  # reported once

        await txns.close_all()
        await txns.open([bad])
        stopping = TransactionCommitter(txns, lambda: {}, lambda _c: None)
        await txns.port(bad).send(replies, b"x" * 10_000, b"k")
        with pytest.raises(Exception, match="transaction failed"):
            await stopping.commit()
    finally:
        await txns.close_all()
        async with TopicAdmin(settings) as admin:
            await admin.delete([inputs, replies])
