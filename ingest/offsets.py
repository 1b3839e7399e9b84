"""Which offsets may be committed: per partition, the lowest offset still unfinished.

A record is *started* when it is read and *finished* when its terminal event
(or its dead-letter record) is acknowledged by the broker. The commit point
of a partition is its lowest started-but-unfinished offset, or one past the
highest offset read when nothing is in flight. So after a crash every
unfinished request is read again — at-least-once — and nothing finished
before the commit point is served twice.

The commit also carries metadata `h=<highest started offset>;a=<attempt>`:
the next owner of the partition serves records up to `h` again as attempt
`a + 1`, so the SDK can tell a retry from the first try — and also every record
up to the partition's end when it was assigned, since the last owner may have
started some of those after its last commit (a re-served request must never
repeat an attempt number: its streamed tokens would mix). When some records
between the commit point and `h` are finished already (a short request
answered behind a long one), the metadata lists the unfinished ones, `u=5,7-9`:
the next owner serves only those again and skips the rest — which exactly-once
delivery needs (their answers are committed), and which spares at-least-once
readers a duplicate. A list too long for Kafka's metadata limit (4096 bytes by
default) goes as a compressed bitmap, `b=<first>:<base64>`; one too long even so is
left out, logged (everything up to `h` is served again).

Each assignment of a partition has an epoch. Verdicts and requests carry the
epoch of the assignment they were read under: `owns` says whether they may
still be acted on (the partition was not revoked or reassigned since), and
`closed` partitions (being handed over) take no new work but may finish what
they hold.
"""

from __future__ import annotations

import base64
import heapq
import itertools
import logging
import re
import zlib
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

_META_RE = re.compile(r"^h=(-?\d+);a=(\d+)(?:;u=([\d,-]*)|;b=(\d+):([A-Za-z0-9+/=]*))?$")
# Kafka's default offset.metadata.max.bytes is 4096; stay well under it.
MAX_UNFINISHED_CHARS = 3000


@dataclass(slots=True)
class _Partition:
    in_flight: set[int] = field(default_factory=set)
    heap: list[int] = field(default_factory=list)  # may hold finished offsets (lazy)
    next_offset: int | None = None  # one past the highest offset read
    redelivered_upto: int = -1  # offsets <= this were started by an earlier owner
    # Offsets <= this are served as `redelivered_attempt` (>= redelivered_upto: records
    # up to the partition's end at assignment may have been started by an earlier owner).
    bumped_upto: int = -1
    redelivered_attempt: int = 0
    # Of the offsets <= redelivered_upto, the ones the last owner left unfinished
    # (None: all of them, as far as anyone knows).
    redelivered_unfinished: frozenset[int] | None = None
    committed: tuple[int, str] | None = None
    # Every offset below this is finished: the group's commit point at assignment.
    floor: int = 0
    reread_logged: bool = False
    epoch: int = 0  # of this assignment
    closed: bool = False  # being handed over: no new work
    silenced: bool = False  # handed over: nothing more is answered


class CommitWatch(Protocol):
    """Told of commits (traces: a request's commit span ends when its offset is)."""

    def committed(self, tp: object, offset: int) -> None:
        """Every offset of `tp` below `offset` is committed."""

    def released(self, tp: object) -> None:
        """`tp` was let go of: nothing more of it is committed from here."""


@dataclass(slots=True)
class OffsetTracker:
    partitions: dict[object, _Partition] = field(default_factory=dict)
    _epochs: itertools.count = field(default_factory=lambda: itertools.count(1))
    watch: CommitWatch | None = None  # None (tracing off) costs nothing

    def assign(self, tp: object, committed_metadata: str | None,
               end_offset: int | None = None, committed_offset: int | None = None) -> int:
        """A partition was assigned; `committed_metadata` is what the last owner left
        with `committed_offset`, `end_offset` the partition's end now. Returns the
        assignment's epoch."""
        part = _Partition(epoch=next(self._epochs), floor=max(committed_offset or 0, 0))
        match = _META_RE.match(committed_metadata or "")
        if match:
            part.redelivered_upto = int(match.group(1))
            part.redelivered_attempt = int(match.group(2)) + 1
            part.bumped_upto = max(part.redelivered_upto, (end_offset or 0) - 1)
            if match.group(3) is not None:
                part.redelivered_unfinished = frozenset(_parse_ranges(match.group(3)))
            elif match.group(4) is not None:
                part.redelivered_unfinished = _unpack_offsets(int(match.group(4)),
                                                              match.group(5))
        self.partitions[tp] = part
        return part.epoch

    def epoch(self, tp: object) -> int | None:
        """The epoch of `tp`'s current assignment; None when it is not assigned (or is
        being handed over)."""
        part = self.partitions.get(tp)
        return part.epoch if part is not None and not part.closed else None

    def owns(self, tp: object, epoch: int) -> bool:
        """Whether work read under `epoch` may still start: `tp` is still assigned under
        that epoch and not being handed over."""
        part = self.partitions.get(tp)
        return part is not None and part.epoch == epoch and not part.closed

    def holds(self, tp: object, epoch: int) -> bool:
        """Whether work read under `epoch` may still be answered (a partition being handed
        over finishes what it holds; a revoked one answers nothing more)."""
        part = self.partitions.get(tp)
        return part is not None and part.epoch == epoch and not part.silenced

    def close(self, tp: object) -> None:
        """`tp` is being handed over: it takes no new work."""
        part = self.partitions.get(tp)
        if part is not None:
            part.closed = True

    def silence(self, tp: object) -> None:
        """`tp` is handed over: nothing more is answered for it (its commit point stays,
        for the last commit)."""
        part = self.partitions.get(tp)
        if part is not None:
            part.closed = part.silenced = True

    def finished_earlier(self, tp: object, offset: int) -> bool:
        """Whether the last owner finished `offset` (its answer is written, and with
        exactly-once delivery committed): it must not be served again."""
        part = self.partitions.get(tp)
        return (part is not None and part.redelivered_unfinished is not None
                and offset <= part.redelivered_upto
                and offset not in part.redelivered_unfinished)

    def read_before(self, tp: object, offset: int) -> bool:
        """Whether `offset` is behind where this assignment of `tp` has read: below the
        commit point it started from, or below its highest offset read. Such a record is
        finished or in flight already; reading it again means the consumer's position
        went back, and it is never served again (logged once an assignment)."""
        part = self.partitions.get(tp)
        if part is None or not (offset < part.floor or (part.next_offset is not None
                                                        and offset < part.next_offset)):
            return False
        if not part.reread_logged:
            part.reread_logged = True
            log.error("%s: offset %d was read again (read up to %s, commit point %d at "
                      "assignment); records already read are not served again", tp, offset,
                      None if part.next_offset is None else part.next_offset - 1, part.floor)
        return True

    def revoke(self, tp: object) -> None:
        self.partitions.pop(tp, None)
        if self.watch is not None:
            self.watch.released(tp)

    def start(self, tp: object, offset: int) -> int:
        """Record that `offset` was read; returns the attempt number to serve it with."""
        part = self.partitions.setdefault(tp, _Partition())
        part.in_flight.add(offset)
        heapq.heappush(part.heap, offset)
        if part.next_offset is None or offset >= part.next_offset:
            part.next_offset = offset + 1
        return part.redelivered_attempt if offset <= part.bumped_upto else 0

    def finish(self, tp: object, offset: int) -> None:
        part = self.partitions.get(tp)
        if part is not None:
            part.in_flight.discard(offset)

    def num_in_flight(self) -> int:
        return sum(len(p.in_flight) for p in self.partitions.values())

    def commit_point(self, tp: object) -> tuple[int, str] | None:
        """(offset, metadata) to commit for `tp`, or None when nothing was read."""
        part = self.partitions.get(tp)
        if part is None or part.next_offset is None:
            return None
        while part.heap and part.heap[0] not in part.in_flight:
            heapq.heappop(part.heap)
        offset = part.heap[0] if part.heap else part.next_offset
        if part.committed is not None and offset < part.committed[0]:
            log.error("the commit point of %s went back from %d to %d (a record below it "
                      "was started again)", tp, part.committed[0], offset)
        highest_started = part.next_offset - 1
        # The highest attempt this owner used: the next one serves everything up to h
        # with one more, so no two owners ever share an attempt number for a record.
        meta = f"h={highest_started};a={part.redelivered_attempt}"
        if part.heap and len(part.in_flight) != highest_started - offset + 1:
            # Holes: some records above the commit point are finished. Name the others.
            unfinished = _format_ranges(sorted(part.in_flight))
            if len(unfinished) <= MAX_UNFINISHED_CHARS:
                meta += f";u={unfinished}"
            elif len(packed := _pack_offsets(offset, part.in_flight)) <= MAX_UNFINISHED_CHARS:
                meta += f";b={packed}"
            else:
                log.error("the unfinished records of %s between %d and %d do not fit the "
                          "commit metadata: its next owner serves all of them again",
                          tp, offset, highest_started)
        return offset, meta

    def pending_commits(self) -> dict[object, tuple[int, str]]:
        """Commit points that changed since `mark_committed`."""
        out = {}
        for tp, part in self.partitions.items():
            point = self.commit_point(tp)
            if point is not None and point != part.committed:
                out[tp] = point
        return out

    def mark_committed(self, commits: dict[object, tuple[int, str]]) -> None:
        for tp, point in commits.items():
            part = self.partitions.get(tp)
            if part is not None:
                part.committed = point
                if self.watch is not None:
                    self.watch.committed(tp, point[0])


def highest_started(committed_metadata: str | None) -> int | None:
    """The highest offset the partition's owner had started when it committed this
    metadata (`h=`); None for metadata not of sluice."""
    match = _META_RE.match(committed_metadata or "")
    return int(match.group(1)) if match else None


def _format_ranges(offsets: list[int]) -> str:
    """Sorted offsets as `5,7-9`."""
    out: list[str] = []
    start = prev = offsets[0] if offsets else 0
    for offset in offsets[1:]:
        if offset != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = offset
        prev = offset
    if offsets:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)


def _pack_offsets(base: int, offsets: set[int]) -> str:
    """`base:<base64 of zlib(bitmap)>`, bit i set for offset base + i: the unfinished
    records when their ranges are too long for the metadata (short answers finished
    around long ones in every other offset, say). A run of finished records compresses
    to almost nothing."""
    bits = bytearray((max(offsets) - base) // 8 + 1)
    for offset in offsets:
        bits[(offset - base) >> 3] |= 1 << ((offset - base) & 7)
    return f"{base}:{base64.b64encode(zlib.compress(bytes(bits), 9)).decode()}"


def _unpack_offsets(base: int, packed: str) -> frozenset[int]:
    bits = zlib.decompress(base64.b64decode(packed))
    return frozenset(base + (i << 3) + j for i, byte in enumerate(bits) if byte
                     for j in range(8) if byte >> j & 1)


def _parse_ranges(text: str) -> list[int]:
    offsets: list[int] = []
    for item in filter(None, text.split(",")):
        first, _, last = item.partition("-")
        offsets.extend(range(int(first), int(last or first) + 1))
    return offsets
