"""A worker that has decided to stop ends its process within the watchdog's deadline,
wherever the shutdown hangs: in a step that never returns, or in the interpreter's exit
waiting for a stuck thread of the loop's executor."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(body: str) -> tuple[int, str, float]:
    script = textwrap.dedent("""
        import concurrent.futures, logging, threading
        logging.basicConfig(level=logging.INFO)
        from worker.supervision import StopWatchdog
    """) + textwrap.dedent(body)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    return out.returncode, out.stderr, time.monotonic() - started


def test_a_step_that_never_returns_ends_with_the_workers_exit_code() -> None:
    code, err, took = _run("""
        watchdog = StopWatchdog(0.5, lambda: 3)
        watchdog.step = "closing the model runtime"
        watchdog.arm()
        threading.Event().wait()
    """)
    assert code == 3
    assert "stuck in: closing the model runtime" in err and "exit code 3" in err
    assert took < 30


def test_a_stuck_executor_thread_does_not_keep_the_process_alive() -> None:
    code, err, _took = _run("""
        pool = concurrent.futures.ThreadPoolExecutor(1)
        pool.submit(threading.Event().wait)  # the interpreter's exit joins this thread
        watchdog = StopWatchdog(0.5, lambda: 0)
        watchdog.step = "exiting the process"
        watchdog.arm()
    """)
    assert code == 0
    assert "stuck in: exiting the process" in err


def test_a_stop_that_ends_in_time_exits_as_it_would() -> None:
    code, err, _took = _run("""
        watchdog = StopWatchdog(5, lambda: 3)
        watchdog.arm()
    """)
    assert code == 0 and "still runs" not in err
