"""The chaos run's offset check: rewinds are violations, a new coordinator's brief
stale answer (Kafka's, see `OffsetWatch`) is counted apart."""

from __future__ import annotations

from bench.chaos_checks import STALE_READ_GRACE_S, OffsetWatch


def test_a_lower_value_from_the_same_coordinator_is_a_rewind() -> None:
    watch = OffsetWatch(0.0)
    watch.observe(0, 7, "h=7;a=0", node=1, now=1.0)
    watch.observe(0, 6, "h=6;a=0", node=1, now=1.2)
    watch.close()
    assert len(watch.rewinds) == 1 and "went back from 7 to 6" in watch.rewinds[0]
    assert watch.stale_reads == []


def test_a_new_coordinator_behind_for_a_moment_is_a_stale_read() -> None:
    watch = OffsetWatch(0.0)
    watch.observe(0, 7, "h=7;a=0", node=1, now=1.0)
    watch.observe(1, 3, "h=3;a=0", node=1, now=1.0)
    for k in range(5):  # node 1 killed; node 2 answers from its lagging watermark
        watch.observe(0, 6, "h=6;a=0", node=2, now=12.0 + 0.2 * k)
    watch.observe(1, 3, "h=3;a=0", node=2, now=12.0)  # another partition, unaffected
    watch.observe(0, 7, "h=7;a=0", node=2, now=13.2)
    watch.observe(0, 6, "h=6;a=0", node=2, now=13.4)  # now it answers lower: a rewind
    watch.close()
    assert len(watch.stale_reads) == 1 and "6 instead of 7" in watch.stale_reads[0]
    assert len(watch.rewinds) == 1 and "coordinator 2; 7 from coordinator 2" in watch.rewinds[0]


def test_lower_for_longer_than_the_grace_is_a_rewind() -> None:
    watch = OffsetWatch(0.0)
    watch.observe(0, 9, "h=9;a=0", node=1, now=1.0)
    watch.observe(0, 4, "h=4;a=0", node=3, now=2.0)
    watch.observe(0, 4, "h=4;a=0", node=3, now=2.0 + STALE_READ_GRACE_S + 0.1)
    assert len(watch.rewinds) == 1 and "from 9 to 4" in watch.rewinds[0]


def test_lower_until_the_end_is_a_rewind() -> None:
    watch = OffsetWatch(0.0)
    watch.observe(0, 9, "h=9;a=0", node=1, now=1.0)
    watch.observe(0, 8, "h=8;a=0", node=2, now=2.0)
    assert watch.rewinds == []
    watch.close()
    assert len(watch.rewinds) == 1 and watch.stale_reads == []


def test_moving_forward_is_no_violation() -> None:
    watch = OffsetWatch(0.0)
    for k, node in enumerate((1, 1, 2, 3, 3)):
        watch.observe(0, k, f"h={k};a=0", node=node, now=float(k))
    watch.close()
    assert watch.rewinds == [] and watch.stale_reads == []
