"""The worker's heap freeze: start-up's objects out of the full collections, and a reload
that frees what the replaced model left in cycles."""

from __future__ import annotations

import gc
import weakref

from common.heap import freeze_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_frozen_heap_is_left_alone_and_a_reload_collects_it_first():
    gc.collect()
    try:
        before = _cycle()  # garbage of the first load, frozen with it
        freeze_heap()
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert before() is not None  # out of the collector's reach while frozen

        young = _cycle()  # the compiler's leftovers: collected before the next freeze
        freeze_heap(collect_first=True)
        assert young() is None and before() is not None

        freeze_heap(collect_first=True, unfreeze_first=True)  # a reload
        assert before() is None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
