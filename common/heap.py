"""The interpreter's heap after start-up: kept out of the garbage collector's full passes.

For a process that is a worker's own (`sluice worker`; `WorkerOptions.freeze_heap`).
A worker imports torch, transformers, aiokafka and the rest before it serves:
~250,000 objects that live as long as the process. Python's full collection
walks every one of them each time it runs — 150-170 ms on a 2-core AMD EPYC,
the whole process stopped (the model step too) — and a busy worker triggers
one every few seconds (`sluice bench kafka`'s bulk runs: one every 2-3 runs of
~2.5 s). Freezing the heap once the model is loaded (`gc.freeze`: those
objects move to a generation no collection visits) leaves the full passes
only what was allocated since; the young generations are untouched, so
garbage made while serving is collected as before.

The first load freezes without collecting first (a full pass there is ~0.16 s
more before the first token; what it would find at start-up is a few dozen
objects); so does the freeze after a compiled decode step is built (its graphs
and guards live as long as the model): a pass then took 0.2 s of the whole
process for 970 garbage objects among ~257,000 new ones (the tiny model), so
those few stay. A reload unfreezes and collects first, so that the replaced
model's cycles are freed.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_heap(*, collect_first: bool = False, unfreeze_first: bool = False) -> None:
    """Move every object the collector tracks to its permanent generation; with
    `collect_first`, collect what is garbage among the others before; with
    `unfreeze_first`, the frozen ones too (a reload)."""
    started = time.perf_counter()
    if unfreeze_first:
        gc.unfreeze()
    collected = f"{gc.collect()} garbage objects collected first, " if collect_first else ""
    gc.freeze()
    # (Not gc.get_freeze_count(): it walks the frozen objects, ~20 ms at start-up.)
    log.info("heap frozen out of the full collections (%s%.3f s)", collected,
             time.perf_counter() - started)
