"""After a stall, a worker writes nothing until its group membership is confirmed."""

from __future__ import annotations

import asyncio
import time

from worker.membership import MembershipGate


class FakeCoordinator:
    """aiokafka's group coordinator as the gate uses it: a member id, and a heartbeat
    that the group answers (or refuses, resetting the membership)."""

    def __init__(self, answers: list[bool | str]):
        self.member_id = "m-1"
        self.generation = 1
        self.answers = answers
        self.heartbeats = 0
        self._rejoin_needed_fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def ensure_coordinator_known(self) -> None:
        return None

    async def _do_heartbeat(self) -> bool:
        self.heartbeats += 1
        alive = self.answers.pop(0)
        if alive == "rebalancing":  # aiokafka: True, and a rejoin asked for
            self._rejoin_needed_fut.set_result(None)
            return True
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


async def test_member_since_counts_only_heartbeats_sent_later_and_answered_plainly() -> None:
    """A fenced partition is taken over again once a heartbeat sent after the fence
    finds the group unchanged (`worker.delivery`): not one sent before, not one
    refused, not aiokafka's "rebalancing" answer (True too, with a rejoin asked)."""
    coordinator = FakeCoordinator([True, False, "rebalancing"])
    gate = MembershipGate(lambda: coordinator, stall_s=3.0, silence_s=5.0)
    gate._tick()  # wraps the coordinator's heartbeat
    before = time.monotonic()
    await coordinator._do_heartbeat()
    assert gate.member_since(before)
    fenced = time.monotonic()
    assert not gate.member_since(fenced)  # answered, but sent before the fence
    coordinator.member_id = "m-1"
    await coordinator._do_heartbeat()  # refused: out of the group
    assert not gate.member_since(fenced)
    coordinator.member_id = "m-1"
    await coordinator._do_heartbeat()  # the group rebalancing
    assert not gate.member_since(fenced)
