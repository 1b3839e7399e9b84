"""The offset tracker: commit points, and attempts for records served again."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ingest.offsets import OffsetTracker


def test_commit_point_is_lowest_unfinished() -> None:
    tracker = OffsetTracker()
    tracker.assign("p0", None)
    for offset in (5, 6, 7):
        assert tracker.start("p0", offset) == 0
    assert tracker.commit_point("p0") == (5, "h=7;a=0")
    tracker.finish("p0", 6)
    assert tracker.commit_point("p0") == (5, "h=7;a=0;u=5,7")  # 6 is done already
    tracker.finish("p0", 5)
    assert tracker.commit_point("p0") == (7, "h=7;a=0")
    tracker.finish("p0", 7)
    assert tracker.commit_point("p0") == (8, "h=7;a=0")


def test_pending_commits_only_when_changed() -> None:
    tracker = OffsetTracker()
    tracker.assign("p0", None)
    tracker.start("p0", 0)
    commits = tracker.pending_commits()
    assert commits == {"p0": (0, "h=0;a=0")}
    tracker.mark_committed(commits)
    assert tracker.pending_commits() == {}
    tracker.finish("p0", 0)
    assert tracker.pending_commits() == {"p0": (1, "h=0;a=0")}


def test_records_a_crashed_owner_finished_are_not_served_again() -> None:
    tracker = OffsetTracker()
    tracker.assign("p0", None)
    for offset in range(10, 20):
        tracker.start("p0", offset)
    for offset in (11, 12, 13, 15, 19):
        tracker.finish("p0", offset)
    point, meta = tracker.commit_point("p0")
    assert (point, meta) == (10, "h=19;a=0;u=10,14,16-18")

    heir = OffsetTracker()
    heir.assign("p0", meta)
    served = [o for o in range(point, 22) if not heir.finished_earlier("p0", o)]
    assert served == [10, 14, 16, 17, 18, 20, 21]
    legacy = OffsetTracker()
    legacy.assign("p0", "h=19;a=0")  # no list: everything up to h is served again
    assert not any(legacy.finished_earlier("p0", o) for o in range(10, 22))


def test_records_left_by_a_crashed_owner_get_the_next_attempt() -> None:
    tracker = OffsetTracker()
    tracker.assign("p0", "h=9;a=0")  # the last owner had started up to offset 9
    assert tracker.start("p0", 8) == 1
    assert tracker.start("p0", 9) == 1
    assert tracker.start("p0", 10) == 0
    # a = the highest attempt used here: the next owner serves 8-10 as attempt 2
    assert tracker.commit_point("p0") == (8, "h=10;a=1")

    again = OffsetTracker()
    again.assign("p0", "h=9;a=1")  # crashed twice
    assert again.start("p0", 9) == 2
    assert again.commit_point("p0") == (9, "h=9;a=2")


def test_records_up_to_the_end_at_assignment_get_the_next_attempt() -> None:
    """The last owner may have started records after its last commit (h): every record
    that existed when the partition was assigned is served with a new attempt."""
    tracker = OffsetTracker()
    tracker.assign("p0", "h=9;a=0", end_offset=14)
    assert [tracker.start("p0", o) for o in (9, 12, 13, 14)] == [1, 1, 1, 0]
    first = OffsetTracker()
    first.assign("p0", None, end_offset=14)  # never committed: nobody served it before
    assert first.start("p0", 3) == 0


def test_epochs_say_whose_work_may_go_on() -> None:
    tracker = OffsetTracker()
    old = tracker.assign("p0", None)
    assert tracker.epoch("p0") == old and tracker.owns("p0", old)
    tracker.close("p0")  # being handed over: no new work, but what it holds may finish
    assert not tracker.owns("p0", old) and tracker.holds("p0", old)
    assert tracker.epoch("p0") is None
    tracker.silence("p0")  # handed over: nothing more is answered, the commit point stays
    assert not tracker.holds("p0", old) and tracker.commit_point("p0") is None
    tracker.start("p0", 4)
    assert tracker.commit_point("p0") == (4, "h=4;a=0")
    tracker.revoke("p0")
    assert not tracker.holds("p0", old)
    new = tracker.assign("p0", None)  # assigned again: the old epoch's work is stale
    assert new != old and tracker.owns("p0", new)
    assert not tracker.owns("p0", old) and not tracker.holds("p0", old)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=60, unique=True), st.randoms())
def test_commit_point_never_passes_an_unfinished_offset(offsets, rnd) -> None:
    tracker = OffsetTracker()
    tracker.assign("p", None)
    offsets = sorted(offsets)
    for offset in offsets:
        tracker.start("p", offset)
    unfinished = set(offsets)
    order = list(offsets)
    rnd.shuffle(order)
    for offset in order:
        tracker.finish("p", offset)
        unfinished.discard(offset)
        point, _ = tracker.commit_point("p")
        assert all(point <= u for u in unfinished)
        if not unfinished:
            assert point == offsets[-1] + 1


def test_unfinished_records_too_many_for_ranges_go_as_a_bitmap():
    """Short answers finished around long ones in every other offset: their ranges
    pass Kafka's metadata limit, and dropped, the next owner would answer again every
    record up to `h` — answers exactly-once had committed. A compressed bitmap fits."""
    from ingest.offsets import MAX_UNFINISHED_CHARS

    tracker = OffsetTracker()
    tracker.assign("p0", None)
    for offset in range(100, 100 + 4000):
        tracker.start("p0", offset)
    for offset in range(101, 100 + 4000, 2):
        tracker.finish("p0", offset)
    point, meta = tracker.commit_point("p0")
    assert point == 100 and meta.startswith("h=4099;a=0;b=100:")
    assert len(meta) <= MAX_UNFINISHED_CHARS + 40

    heir = OffsetTracker()
    heir.assign("p0", meta, end_offset=4100)
    assert not any(heir.finished_earlier("p0", o) for o in range(100, 4100, 2))
    assert all(heir.finished_earlier("p0", o) for o in range(101, 4100, 2))


def test_a_record_read_again_is_not_served_again():
    tracker = OffsetTracker()
    tracker.assign("p0", "h=9;a=0", end_offset=12, committed_offset=10)
    assert all(tracker.read_before("p0", o) for o in range(10))  # below the commit point
    assert not tracker.read_before("p0", 10)
    tracker.start("p0", 10)
    tracker.start("p0", 11)
    tracker.finish("p0", 11)
    assert tracker.read_before("p0", 10)  # in flight
    assert tracker.read_before("p0", 11)  # finished by this owner
    assert not tracker.read_before("p0", 12)
    fresh = OffsetTracker()
    fresh.assign("p0", None)  # never committed: read from the log's start
    assert not fresh.read_before("p0", 0)
