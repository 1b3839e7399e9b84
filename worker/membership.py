"""A worker that was paused writes nothing until it knows it is still a group member.

A worker stopped for longer than its session timeout — a GC pause, a stalled VM,
SIGSTOP — is dropped from the consumer group and its partitions go to others,
which serve its requests again. When it wakes, the step it was running finishes
at once and its events would be written before its consumer has heard, at its
next heartbeat, that it is out: answers a second time. Exactly-once delivery is
safe anyway (the partitions' new owners have fenced its transactional ids), but
at-least-once readers would see a second answer under the same attempt.

A worker cut off from its group coordinator (a network partition) runs on, but is
dropped the same way, and when the cut heals, records it fetches before its next
heartbeat hears the news would be answered twice under the same attempt (`sluice
bench chaos --networked`: 20 requests once the worker cut from the brokers was back).

`MembershipGate` watches the event loop's clock: a tick that comes more than
`stall_s` late means the process did not run for that long. It also watches the
group coordinator's heartbeats: none answered for `silence_s` (less than the
session timeout) while a member means the session may expire. After either,
`confirmed()` holds every write until a heartbeat of its own says the group still
knows this member (True: write on), or says it does not (False: drop the event —
the rebalance that follows drops the rest). Otherwise it costs a clock read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

TICK_S = 0.1
RETRY_S = 0.5


class MembershipGate:
    def __init__(self, coordinator_of: Callable[[], Any], stall_s: float,
                 silence_s: float | None = None):
        self._coordinator_of = coordinator_of  # aiokafka's group coordinator, or None
        self._stall_s = stall_s
        self._silence_s = silence_s  # None: heartbeats not watched
        self._last_tick = time.monotonic()
        self._suspect = False
        self._checking = asyncio.Lock()
        self.num_stalls = 0
        # The coordinator whose heartbeats are watched, its membership then, and when
        # it last answered one (or joined: a join is an answer too).
        self._watched: Any = None
        self._membership: tuple[str, int] = ("", -1)
        self.last_answer = time.monotonic()
        # When the latest heartbeat the group answered as a member of its current
        # generation, no rebalance pending, was sent (`member_since`).
        self._confirmed_sent = float("-inf")

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._tick()

    def _tick(self) -> None:
        now = time.monotonic()
        late = now - self._last_tick - TICK_S
        self._last_tick = now
        if late > self._stall_s and not self._suspect:
            self._suspect = True
            self.num_stalls += 1
            log.warning("this worker did not run for %.1f s (paused?): writing nothing until "
                        "a heartbeat says it is still a member of its consumer group", late)
        if self._silence_s is not None:
            self._watch_heartbeats(now)

    def _watch_heartbeats(self, now: float) -> None:
        coordinator = self._coordinator_of()
        if coordinator is None:
            return
        if coordinator is not self._watched:
            self._watched = coordinator
            self._wrap(coordinator)
            self.last_answer = now
        membership = (coordinator.member_id, coordinator.generation)
        if membership != self._membership:  # joined (or reset): counts as heard
            self._membership = membership
            self.last_answer = now
        silent = now - self.last_answer
        if (coordinator.member_id and not self._suspect and self._silence_s is not None
                and silent > self._silence_s):
            self._suspect = True
            self.num_stalls += 1
            log.warning("no heartbeat of this worker answered for %.1f s (cut off from its "
                        "group coordinator?): writing nothing until one says it is still a "
                        "member of its consumer group", silent)

    def _wrap(self, coordinator: Any) -> None:
        """Note each heartbeat the coordinator answers (aiokafka keeps that to itself)."""
        beat = coordinator._do_heartbeat

        async def heartbeat() -> bool:
            sent = time.monotonic()
            alive = await beat()
            if alive:
                self.last_answer = time.monotonic()
                # aiokafka answers True to "rebalancing" too, and asks to rejoin then.
                if not coordinator._rejoin_needed_fut.done():
                    self._confirmed_sent = max(self._confirmed_sent, sent)
            return bool(alive)

        coordinator._do_heartbeat = heartbeat

    def member_since(self, moment: float) -> bool:
        """Whether a heartbeat sent after `moment` (time.monotonic) was answered with
        this worker a member of the group's current generation and no rebalance under
        way: what it was assigned then is still its own."""
        return self._confirmed_sent > moment

    async def confirmed(self) -> bool:
        """Whether writes may go on: at once without a stall; after one, once the group
        coordinator has answered a heartbeat (False: this member is gone)."""
        if time.monotonic() - self._last_tick > self._stall_s + TICK_S:
            self._tick()  # the writer ran before the clock did after the stall
        if not self._suspect:
            return True
        async with self._checking:
            while self._suspect:
                coordinator = self._coordinator_of()
                if coordinator is None or not coordinator.member_id:
                    return False
                try:
                    await coordinator.ensure_coordinator_known()
                    # aiokafka's own heartbeat, sent now: True while the group knows
                    # this member; a refusal resets its membership (and rejoins).
                    alive = await coordinator._do_heartbeat()
                except Exception as exc:  # the coordinator away: ask again
                    log.warning("heartbeat after a stall failed (%s: %s); asking again",
                                type(exc).__name__, exc)
                    alive = False
                if alive:
                    self._suspect = False
                    self.last_answer = time.monotonic()
                    log.info("still a member of the consumer group after the stall; "
                             "writing again")
                    return True
                if not coordinator.member_id:
                    log.warning("out of the consumer group after the stall: its partitions "
                                "are served elsewhere; dropping what it would have written")
                    return False
                await asyncio.sleep(RETRY_S)
        return True
