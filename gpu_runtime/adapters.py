"""Registered adapters in host memory, resident ones in device slots, LRU swaps.

`AdapterManager` satisfies the batcher's `AdapterSlots` protocol
(`resident_adapters()`, `load_adapters(wanted, in_use)`). Every registered
adapter's weights stay in CPU memory (pinned on CUDA), already scaled and in
the model's dtype, so a swap is one host-to-device copy per projection. Swaps
happen only between steps: from `load_adapters` (the batcher) or from
`ensure_resident` (the runtime, before a step that needs an adapter that is
not resident). The victim is the least recently used adapter that the step
does not use.

The slots' width `rank` is the largest rank among resident adapters; when it
changes, every slot is rewritten at the new width (see lora.py).

Under tensor parallelism every rank has an `AdapterManager` holding its shard
of each adapter (`layout`: A or B split like the base layer, see
`ShardLayout.lora_shards`). Rank 0's manager is the one the batcher drives;
the others copy its slot assignment with `mirror` before each step, so slot
choice and LRU order live in one place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_runtime.config import ModelConfig
from gpu_runtime.errors import AdapterError, SchedulingError
from gpu_runtime.lora import LoraLinear
from gpu_runtime.lora_format import AdapterInfo, load_adapter
from gpu_runtime.parallel import ShardLayout

HostPair = tuple[torch.Tensor, torch.Tensor]  # (A [r, in], scale * B^T [r, out]), model dtype


@dataclass(slots=True)
class _Adapter:
    info: AdapterInfo
    weights: dict[tuple[int, str], HostPair]
    last_used: int = 0  # the step counter when a step last used it


class AdapterManager:
    def __init__(
        self,
        model_config: ModelConfig,
        layers: dict[tuple[int, str], LoraLinear],
        num_slots: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
        layout: ShardLayout | None = None,
    ) -> None:
        self.model_config = model_config
        self.layout = layout
        self.layers = layers
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.adapters: dict[str, _Adapter] = {}
        self.slots: list[str | None] = [None] * num_slots
        self.rank = 0
        self.num_adapter_loads = 0  # host -> device copies of one adapter
        self.num_adapter_swaps = 0  # loads that evicted a resident adapter
        self._clock = 0

    # ---- registration -----------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def register(self, name: str, path: str | Path) -> AdapterInfo:
        """Validate and read an adapter into host memory; raises `AdapterError`."""
        if not self.slots:
            raise AdapterError("this runtime has max_adapters=0: LoRA adapters are disabled")
        if name in self.adapters:
            raise AdapterError(f"adapter {name!r} is already registered")
        info, tensors = load_adapter(self.model_config, path, self.max_lora_rank)
        weights = {}
        for key, (a, b) in tensors.items():
            pair = (a.to(self.dtype), (b.T * info.scale).to(self.dtype).contiguous())
            if self.layout is not None:
                shards = self.layout.lora_shards(key[1])  # this rank's part, like the base layer
                pair = tuple(
                    t if s is None else s.take(t) for t, s in zip(pair, shards, strict=True)
                )
            weights[key] = tuple(t.pin_memory() for t in pair) if self.pin_memory else pair
        self.adapters[name] = _Adapter(info, weights)
        return info

    def unregister(self, name: str) -> bool:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            return False
        if name in self.slots:
            slot = self.slots.index(name)
            self.slots[slot] = None
            if not self._set_rank():
                self._write(slot, None)
        return True

    # ---- the AdapterSlots protocol ----------------------------------------------------

    def resident_adapters(self) -> frozenset[str]:
        return frozenset(n for n in self.slots if n is not None)

    def load_adapters(self, wanted: Sequence[str], in_use: frozenset[str]) -> None:
        """Load `wanted` adapters (in order) into free slots or over LRU adapters not in use.

        Stops when no slot can be freed; unknown names are skipped (the batcher
        only learns of registrations through the control plane).
        """
        keep = set(in_use) | set(wanted)
        for name in wanted:
            if name in self.slots or name not in self.adapters:
                continue
            slot = self._free_slot(keep)
            if slot is None:
                return
            self._load(name, slot)

    # ---- used by the runtime ----------------------------------------------------------

    def slot_of(self, name: str) -> int:
        return self.slots.index(name)

    def ensure_resident(self, names: Iterable[str]) -> dict[str, int]:
        """Make every adapter of a step resident and mark it used; returns name -> slot."""
        names = set(names)
        if len(names) > len(self.slots):
            raise SchedulingError(
                f"a step uses {len(names)} adapters; there are {len(self.slots)} slots"
            )
        unknown = names - self.adapters.keys()
        if unknown:
            raise SchedulingError(f"adapters not registered: {sorted(unknown)}")
        for name in sorted(names):
            if name not in self.slots:
                slot = self._free_slot(names)
                assert slot is not None, "more adapters than slots was checked above"
                self._load(name, slot)
        self._clock += 1
        for name in names:
            self.adapters[name].last_used = self._clock
        return {name: self.slots.index(name) for name in names}

    def mirror(self, slots: Sequence[str | None]) -> None:
        """Take rank 0's slot assignment (tensor parallelism): load what differs."""
        changed = [i for i, (a, b) in enumerate(zip(self.slots, slots, strict=True)) if a != b]
        if not changed:
            return
        self.slots = list(slots)
        if not self._set_rank():
            for slot in changed:
                self._write(slot, self.slots[slot])

    # ---- slots ------------------------------------------------------------------------

    def _free_slot(self, keep: set[str]) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        victims = [n for n in self.slots if n not in keep]
        if not victims:
            return None
        victim = min(victims, key=lambda n: self.adapters[n].last_used)
        self.num_adapter_swaps += 1
        return self.slots.index(victim)

    def _load(self, name: str, slot: int) -> None:
        self.slots[slot] = name
        self.num_adapter_loads += 1
        if not self._set_rank():
            self._write(slot, name)

    def _set_rank(self) -> bool:
        """Re-width every slot to the largest resident rank; True if it changed (all written)."""
        ranks = [self.adapters[n].info.rank for n in self.slots if n is not None]
        rank = max(ranks, default=0)
        if rank == self.rank:
            return False
        self.rank = rank
        for layer in self.layers.values():
            layer.set_rank(rank)
        for slot, name in enumerate(self.slots):
            if name is not None:
                self._write(slot, name)
        return True

    def _write(self, slot: int, name: str | None) -> None:
        weights = self.adapters[name].weights if name is not None else {}
        for key, layer in self.layers.items():
            layer.write_slot(slot, weights.get(key))
