"""After a stall, a worker writes nothing until its group membership is confirmed."""

from __future__ import annotations

import time

from worker.membership import MembershipGate


class FakeCoordinator:
    """aiokafka's group coordinator as the gate uses it: a member id, and a heartbeat
    that the group answers (or refuses, resetting the membership)."""

    def __init__(self, answers: list[bool]):
        self.member_id = "m-1"
        self.generation = 1
        self.answers = answers
        self.heartbeats = 0

    async def ensure_coordinator_known(self) -> None:
        return None

    async def _do_heartbeat(self) -> bool:
        self.heartbeats += 1
        alive = self.answers.pop(0)
        if not alive:
            self.member_id = ""  # aiokafka's reset_generation
        return alive


async def test_no_stall_costs_no_heartbeat() -> None:
    coordinator = FakeCoordinator([])
    gate = MembershipGate(lambda: coordinator, stall_s=3.0)
    assert await gate.confirmed() and coordinator.heartbeats == 0


async def test_after_a_stall_a_heartbeat_decides() -> None:
    coordinator = FakeCoordinator([True])
    gate = MembershipGate(lambda: coordinator, stall_s=3.0)
    gate._last_tick = time.monotonic() - 30  # the process did not run for 30 s
    assert await gate.confirmed() and coordinator.heartbeats == 1
    assert await gate.confirmed() and coordinator.heartbeats == 1  # confirmed: no more
    assert gate.num_stalls == 1

    gone = FakeCoordinator([False])
    gate = MembershipGate(lambda: gone, stall_s=3.0)
    gate._last_tick = time.monotonic() - 30
    assert not await gate.confirmed()  # out of the group: its writes are dropped
    assert not await gate.confirmed() and gone.heartbeats == 1
    gone.member_id, gone.answers = "m-2", [True]  # rejoined: writes go on
    assert await gate.confirmed()


async def test_heartbeats_unanswered_past_the_silence_hold_writes() -> None:
    """A worker cut off from its group coordinator runs on: no stall, but no heartbeat
    answered. Past `silence_s` it writes nothing until a heartbeat decides (the cut
    healed, its session long expired: out, so its late answers are dropped)."""
    coordinator = FakeCoordinator([False])
    gate = MembershipGate(lambda: coordinator, stall_s=3.0, silence_s=5.0)
    gate._tick()  # watches the coordinator's heartbeats from now
    assert await gate.confirmed() and coordinator.heartbeats == 0
    gate.last_answer = time.monotonic() - 6  # none answered for 6 s
    gate._tick()
    assert not await gate.confirmed()  # the heartbeat it sends is refused: dropped
    assert gate.num_stalls == 1

    # Answered heartbeats keep it writing, however long it runs.
    alive = FakeCoordinator([True, True])
    gate = MembershipGate(lambda: alive, stall_s=3.0, silence_s=5.0)
    gate._tick()
    await alive._do_heartbeat()  # the wrapped heartbeat notes the answer
    assert time.monotonic() - gate.last_answer < 1
    gate._tick()
    assert await gate.confirmed() and gate.num_stalls == 0
