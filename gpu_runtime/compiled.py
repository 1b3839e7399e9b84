"""The decode step through `torch.compile` (inductor), with an eager fallback.

A decode step of a small model spends a good share of its time dispatching
small ops (about forty per layer); inductor fuses the norms, RoPE, SiLU gating
and residual adds into a few kernels. Only steps whose rows are all decodes and
use no adapter take the compiled graph; prefill chunks (a Python loop over
ragged sequences, compute-bound anyway) and LoRA steps run eagerly. Paged
attention and the cache write are custom ops inside the graph (see
`attention.py`).

Weights and the KV cache have static shapes; the batch and key-length dims are
marked dynamic at each call (`_mark_dynamic`). Dynamo specialises size 1, so
batch 1 gets a graph of its own: two graphs in all (decode block tables are
padded to two columns or more, so a one-block table adds none).
`Runtime.warm_up` compiles both on a scratch KV block; until it has, every step
is eager (`ready`), so compiling never happens on a live step's critical path
and can run in another thread while the step thread serves (a worker does so:
it answers its first requests eagerly and swaps the graphs in when they are
ready). Inductor's caches live on disk (`TORCHINDUCTOR_CACHE_DIR`, default
`~/.cache/sluice/inductor`), so a restart mostly re-traces and skips code
generation.

The graph is traced with `fullgraph=True`: a graph break is an error, not a
silently slower step. Any failure of the compiled step (a compiler error, an
unsupported op) is logged with its traceback and the runtime steps eagerly
from then on; the failed step is recomputed eagerly (its cache writes are
idempotent), so no request sees it. `failure` says why (the worker logs it;
the benchmarks refuse to report eager figures as compiled ones).
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_runtime.context import StepContext

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, StepContext], torch.Tensor]


def sluice_cache_dir(kind: str) -> Path:
    """`~/.cache/sluice/<kind>` (`XDG_CACHE_HOME`): what the runtime builds once per
    machine (infra.common's root; this room cannot import it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluice" / kind


def default_cache_dir() -> Path:
    return sluice_cache_dir("inductor")


def _own_code(forward: Forward) -> Forward:
    """`forward` (a bound method) over a copy of its code object. Dynamo keeps its
    graphs, and its recompile limit, per code object: without the copy every model
    in the process (a worker's next revision, a benchmark's second runtime) would
    share `CausalLM.forward`'s eight entries and soon fail on the limit."""
    func = forward.__func__  # type: ignore[attr-defined]
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__,
                              func.__defaults__, func.__closure__)
    return types.MethodType(copy, forward.__self__)  # type: ignore[attr-defined]


def _mark_dynamic(input_ids: torch.Tensor, ctx: StepContext) -> None:
    """The batch and key-length dims vary step to step. Size 1 is left alone: dynamo
    specialises it anyway (batch 1 gets its own graph)."""
    dims: list[tuple[torch.Tensor | None, int]] = [
        (input_ids, 0), (ctx.positions, 0), (ctx.slot_mapping, 0),
        (ctx.decode_block_tables, 0), (ctx.decode_block_tables, 1),
        (ctx.decode_mask, 0), (ctx.decode_mask, 3),
        (ctx.decode_window_mask, 0), (ctx.decode_window_mask, 3),
        (ctx.block_tables, 0), (ctx.block_tables, 1),
        (ctx.token_seq_idx, 0), (ctx.token_ctx_len, 0),
    ]
    for tensor, dim in dims:
        if tensor is not None and tensor.shape[dim] > 1:
            torch._dynamo.mark_dynamic(tensor, dim)


class CompiledStep:
    """Calls `forward` compiled for all-decode steps without LoRA, eagerly otherwise."""

    def __init__(self, forward: Forward, backend: str | Callable = "inductor") -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir()))
        self.eager = forward
        self._backend = backend
        self._compiled: Forward | None = None  # made at the first compiled call (`warm`)
        self.failure: str | None = None  # why the runtime fell back to eager steps
        self.ready = False  # both graphs compiled (`warm`): live steps may take them
        self.compiled_steps = 0
        self.warmup_s: float | None = None

    @property
    def compiled(self) -> Forward:
        """`forward` through torch.compile. Made on first use, so that importing dynamo
        and inductor (1.4 s) happens in the warm-up's thread, not while a worker loads."""
        if self._compiled is None:
            # Static shapes but for the dims `_mark_dynamic` names: weights and the KV cache
            # keep theirs, so inductor specialises on them. No guards on the modules: their
            # weights and structure are fixed once loaded (layer swaps happen before), and
            # checking every parameter at every step cost ~1.4 ms of a 45 ms batch-1 step.
            self._compiled = torch.compile(
                _own_code(self.eager), dynamic=False, fullgraph=True, backend=self._backend,
                options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
            )
        return self._compiled

    def takes(self, ctx: StepContext) -> bool:
        return (
            self.ready and self.failure is None and not ctx.prefills and ctx.lora is None
            and ctx.num_decodes > 0
        )

    def warm(self, steps: list[tuple[torch.Tensor, StepContext]]) -> bool:
        """Compile (and run) the graphs of `steps`, all-decode steps on scratch blocks;
        then live steps take them. False, with `failure` said, if compiling failed."""
        for input_ids, ctx in steps:
            if self._compiled_or_failure(input_ids, ctx) is None:
                return False
        self.ready = True
        return True

    def __call__(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if not self.takes(ctx):
            return self.eager(input_ids, ctx)
        hidden = self._compiled_or_failure(input_ids, ctx)
        return hidden if hidden is not None else self.eager(input_ids, ctx)

    def _compiled_or_failure(self, input_ids: torch.Tensor,
                             ctx: StepContext) -> torch.Tensor | None:
        try:
            _mark_dynamic(input_ids, ctx)
            ctx.in_graph = True
            hidden = self.compiled(input_ids, ctx)
        except Exception as exc:  # the compiler's failure is not the request's
            self.failure = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            log.error("the compiled decode step failed; this runtime steps eagerly from "
                      "now on", exc_info=exc)
            ctx.in_graph = False  # the step is recomputed eagerly
            return None
        self.compiled_steps += 1
        return hidden
