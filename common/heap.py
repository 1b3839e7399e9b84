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
objects). Later freezes collect first, which is cheap once start-up's heap is
frozen: after the compiled decode step is built (its graphs and guards live as
long as the model; what the compiler dropped must not be kept), and on a reload,
which unfreezes first so that the replaced model's cycles are freed.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_heap(*, collect_first: bool = False, unfreeze_first: bool = False) -> None:
    """Move every object the collector tracks to its permanent generation; with
    `collect_first`, collect what is garbage among the others before; with
    `unfreeze_first`, the frozen ones too (a reload)."""
    if unfreeze_first:
        gc.unfreeze()
    if collect_first:
        gc.collect()
    gc.freeze()
    log.debug("heap frozen: %d objects out of the full collections", gc.get_freeze_count())
