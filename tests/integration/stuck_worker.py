"""A worker whose runtime never finishes closing, as a process of its own
(`python -m tests.integration.stuck_worker MODEL DEADLINE_S`): the test that a decided
stop still ends the process stops it with SIGTERM and times its exit."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading

import uvloop

from common.logs import setup_logging
from common.settings import Settings
from gpu_runtime import Runtime
from worker.supervision import StopWatchdog
from worker.worker import Worker, WorkerOptions


class NeverClosingRuntime(Runtime):
    def close(self) -> None:
        threading.Event().wait()  # as a device call that never returns


def main() -> None:
    model, deadline_s = sys.argv[1], float(sys.argv[2])
    setup_logging("INFO")
    worker: Worker | None = None
    watchdog = StopWatchdog(deadline_s, lambda: 3 if worker and worker.fatal else 0)
    worker = Worker(Settings.load(), WorkerOptions(model=model, instance_id="stuck-0"),
                    runtime_factory=NeverClosingRuntime, watchdog=watchdog)

    async def run() -> None:
        assert worker is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
        await worker.run()

    uvloop.run(run())


if __name__ == "__main__":
    main()
