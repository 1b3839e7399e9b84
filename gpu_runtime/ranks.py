"""The process model of a tensor-parallel replica: one process per rank.

    rank 0 (the Runtime's process)                 ranks 1..tp-1 (helpers, spawned)
    ─────────────────────────────                  ────────────────────────────────
    plan memory; TCPStore on 127.0.0.1:0  ──port──▶ join the store
    init_process_group ◀──────────────────────────▶ init_process_group
    build its shard                                 build its shard; store "ready/r"
    wait for every "ready/r" (or "error/r")
    execute(plan):
      batcher-side checks, block tables,
      adapter slots (rank 0 only)
      broadcast ("step", seqs, rows, slots) ──────▶ mirror the adapter slots
      forward its shard ◀── all-reduces ──────────▶ forward its shard
      gather logits, sample                         (its logits go to rank 0)
    register_adapter ─ ("register", name, path) ──▶ load its shard of the adapter
    close() ─ ("stop",) ──────────────────────────▶ leave the group, exit

Helpers are `torch.multiprocessing` "spawn" processes (daemonic: a normal exit
of rank 0 terminates them). Two process groups, both held in `RankGroup`:
`compute` for the forward's collectives (NCCL on CUDA, gloo on CPU, timeout
`RuntimeConfig.tp_timeout_s`) and `control` for the commands (gloo, pickled
into uint8 tensors on the CPU). Helpers wait for commands without a practical
deadline (the control group's timeout is a year): an idle replica must not
fall apart; rank 0 waits for each send at most `tp_timeout_s`.
torch requires a default group to make groups at all; it is the `compute`
group, and every collective names its group explicitly.

Failure handling. Rank 0 checks the helpers' exit codes before every command,
and a collective with a dead peer fails at once (the peer's sockets close) or,
for a hung peer, after `tp_timeout_s`; either way `execute` raises
`RankFailure` and every later call does too: close the Runtime and build a new
one. Helpers follow rank 0: they ignore SIGINT (Ctrl-C reaches the whole
process group; rank 0 decides), exit when a collective fails (rank 0's
sockets closed), and a watchdog thread exits when their parent process is
gone (SIGKILL or SIGTERM of rank 0 runs no cleanup). On CUDA a rank that dies
inside an NCCL collective is caught by NCCL's own watchdog after the timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_runtime.adapters import AdapterManager
from gpu_runtime.compiled import CompiledStep
from gpu_runtime.config import ModelConfig, RuntimeConfig
from gpu_runtime.cpu_attention import NativeDecodeAttention, time_prefill, why_not_native
from gpu_runtime.cpu_attention import load as load_native_attention
from gpu_runtime.cpu_decode import MAX_ROWS as MAX_DECODE_ROWS
from gpu_runtime.cpu_decode import NativeDecoder, why_not_for_config, why_not_native_decode
from gpu_runtime.cpu_linear import pack_cpu_linears, why_not_packed
from gpu_runtime.errors import ModelLoadError, RankFailure
from gpu_runtime.loader import load_model
from gpu_runtime.lora import apply_lora
from gpu_runtime.parallel import ShardLayout, wrap_parallel_linears
from gpu_runtime.runner import ModelRunner, ScheduledSeq

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=365)
Command = tuple[Any, ...]


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r runs on `cuda:(i + r)` where `cuda:i` is the replica's device; CPU stays CPU."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


# Starting a rank (spawn, import torch, rendezvous) can take far longer than a
# step on a busy host; the short `tp_timeout_s` bounds commands, not start-up.
STARTUP_TIMEOUT_S = 300.0


def startup_timeout(timeout_s: float) -> float:
    return max(timeout_s, STARTUP_TIMEOUT_S)


@dataclass(slots=True)
class RankGroup:
    """This process's place in a replica and the two groups it talks over."""

    rank: int
    size: int
    compute: dist.ProcessGroup  # the forward's all-reduces and the logits gather
    control: dist.ProcessGroup  # gloo: commands broadcast by rank 0

    @classmethod
    def join(
        cls, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float
    ) -> RankGroup:
        cuda = device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=store,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=startup_timeout(timeout_s)),
            device_id=device if cuda else None,
        )
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        return cls(rank, size, dist.group.WORLD, control)

    def send(self, command: Command, timeout_s: float) -> None:
        """Rank 0: broadcast a command (pickled, as tensors), waiting at most `timeout_s`.

        gloo's send waits for the receiver to post its receive, so a hung helper
        would block rank 0 for the control group's year-long timeout without the
        bounded wait.
        """
        payload = torch.frombuffer(bytearray(pickle.dumps(command)), dtype=torch.uint8)  # [n]
        size = torch.tensor([payload.numel()], dtype=torch.int64)  # [1]
        for tensor in (size, payload):
            work = dist.broadcast(tensor, group_src=0, group=self.control, async_op=True)
            work.wait(timeout=timedelta(seconds=timeout_s))

    def receive(self) -> Command:
        """Ranks 1..tp-1: the next command, however long rank 0 stays idle."""
        size = torch.empty(1, dtype=torch.int64)  # [1]
        dist.broadcast(size, group_src=0, group=self.control)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)  # [n]
        dist.broadcast(payload, group_src=0, group=self.control)
        return pickle.loads(payload.numpy().tobytes())


def build_shard(
    model_path: str | Path,
    mc: ModelConfig,
    config: RuntimeConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
    max_model_len: int,
    ranks: RankGroup | None = None,
) -> tuple[ModelRunner, AdapterManager]:
    """The model (this rank's shard of it with `ranks`), its layer swaps, its KV cache."""
    layout = ShardLayout(mc, ranks.size, ranks.rank) if ranks is not None else None
    group = ranks.compute if ranks is not None else None
    # FP8 weights are quantized as they are read (the full-precision model is never held).
    model = load_model(model_path, mc, dtype, device, layout, group, config.quantization)
    lora_layers = {}
    if config.max_adapters > 0:
        lora_layers = apply_lora(model, config.max_adapters, config.max_lora_rank, dtype)
    if group is not None:  # last: a row-parallel all-reduce covers base output and LoRA delta
        wrap_parallel_linears(model, group)
    decoder = None
    if device.type == "cpu":  # before packing: it copies the plain projections' rows
        reason = (why_not_for_config(config, device, dtype)
                  or why_not_native_decode(model, mc, device, dtype, config.compile))
        if reason is None:
            decoder = NativeDecoder(model, mc)
            log.info("CPU decode steps of up to %d rows in one native call over all layers "
                     "(its weight copy: %.1f MB)%s", decoder.max_rows, decoder.extra_bytes / 1e6,
                     "; larger steps on oneDNN's AMX products" if decoder.max_rows < MAX_DECODE_ROWS
                     else "")
        else:
            log.info("CPU decode steps stay on the torch path: %s", reason)
    if device.type == "cpu":  # after every other swap: it packs the plain `Linear`s left
        reason = (why_not_packed(device, dtype, config.compile) if config.cpu_prepack
                  else "cpu_prepack is off")
        if reason is None:
            fused, packed = pack_cpu_linears(model)
            log.info("CPU projections on oneDNN's prepacked weights: %d fused groups "
                     "(q/k/v, gate/up), %d single", fused, packed)
        else:
            log.info("CPU projections stay on F.linear: %s", reason)
    adapters = AdapterManager(
        mc, lora_layers, config.max_adapters, config.max_lora_rank, dtype,
        pin_memory=device.type == "cuda", layout=layout,
    )  # fmt: skip
    native, native_prefill = None, True
    if device.type == "cpu":
        reason = (why_not_native(device, dtype, mc.head_dim, mc.num_heads // mc.num_kv_heads,
                                 config.compile)
                  if config.cpu_native_attention else "cpu_native_attention is off")
        if reason is None:
            native, reason = load_native_attention()
        if native is not None:
            native_prefill = _prefill_natively(native, config, mc, dtype,
                                               ranks.size if ranks is not None else 1)
            log.info("CPU attention on the native kernels (paged cache read in place): "
                     "decode rows and %s", "prefill chunks" if native_prefill
                     else "not prefill chunks (SDPA)")
        else:
            log.info("CPU attention stays on the torch path: %s", reason)
    runner = ModelRunner(model, num_blocks, config.block_size, max_model_len, config.compile,
                         native, decoder, native_prefill)
    return runner, adapters


def _prefill_natively(native: NativeDecodeAttention, config: RuntimeConfig, mc: ModelConfig,
                      dtype: torch.dtype, num_ranks: int) -> bool:
    """config.cpu_native_prefill, or when None the faster of the kernel and SDPA on
    this rank's heads, timed here (logged either way)."""
    if config.cpu_native_prefill is not None:
        return config.cpu_native_prefill
    kv_heads = max(1, mc.num_kv_heads // num_ranks)
    heads = kv_heads * (mc.num_heads // mc.num_kv_heads)
    native_s, sdpa_s = time_prefill(native, dtype, heads, kv_heads, mc.head_dim,
                                    config.block_size)
    log.info("CPU prefill attention, one layer's 256 test rows: native kernel %.2f ms, "
             "SDPA %.2f ms", native_s * 1e3, sdpa_s * 1e3)
    return native_s <= sdpa_s


@dataclass(frozen=True, slots=True)
class _RankSpec:
    model_path: str
    config: RuntimeConfig
    dtype: torch.dtype
    rank: int
    port: int
    parent_pid: int
    num_blocks: int
    max_model_len: int


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(1)  # rank 0 is gone: nothing to clean up that the OS won't

    threading.Thread(target=watch, name="sluice-parent-watch", daemon=True).start()


def _rank_main(spec: _RankSpec) -> None:
    """Entry point of a helper rank (a spawned process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(spec.parent_pid)
    cfg, tp = spec.config, spec.config.tp
    device = rank_device(cfg.device, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # share the cores with the other ranks instead of oversubscribing them
        torch.set_num_threads(max(1, torch.get_num_threads() // tp))
    store = dist.TCPStore(
        "127.0.0.1", spec.port, tp, False,
        timeout=timedelta(seconds=startup_timeout(cfg.tp_timeout_s)),
    )
    try:
        ranks = RankGroup.join(store, spec.rank, tp, device, cfg.tp_timeout_s)
        mc = ModelConfig.from_dir(spec.model_path)
        runner, adapters = build_shard(
            spec.model_path, mc, cfg, spec.dtype, device, spec.num_blocks, spec.max_model_len, ranks
        )
    except Exception as exc:
        store.set(f"error/{spec.rank}", f"{type(exc).__name__}: {exc}")
        raise
    store.set(f"ready/{spec.rank}", "1")
    _serve(ranks, runner, adapters)


def _serve(ranks: RankGroup, runner: ModelRunner, adapters: AdapterManager) -> None:
    """Run rank 0's commands until "stop"; any error ends the process (rank 0 notices)."""
    while True:
        command = ranks.receive()
        kind = command[0]
        if kind == "step":
            _, seqs, rows_to_sample, slots = command
            adapters.mirror(slots)
            runner.forward(seqs, rows_to_sample)
        elif kind == "warm_up":
            runner.warm_up()
        elif kind == "register":
            adapters.register(command[1], command[2])
        elif kind == "unregister":
            adapters.unregister(command[1])
        elif kind == "stop":
            dist.destroy_process_group()
            return
        else:
            raise RuntimeError(f"unknown command {kind!r}")


class HelperRanks:
    """Rank 0's handle on the helper processes (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path,
        config: RuntimeConfig,
        dtype: torch.dtype,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        if dist.is_initialized():
            raise ModelLoadError(
                "this process already runs a tensor-parallel runtime; close it first"
            )
        tp, self.timeout_s = config.tp, config.tp_timeout_s
        self.store = dist.TCPStore(
            "127.0.0.1", 0, tp, True, timeout=timedelta(seconds=startup_timeout(self.timeout_s)),
            wait_for_workers=False,
        )  # fmt: skip
        self.failure: str | None = None
        self.ready = False  # every helper built its shard and waits for commands
        self.closed = False
        # One command at a time: the commands' order is the collectives' order on every rank.
        self.lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self.processes: list[mp.Process] = []
        for rank in range(1, tp):
            spec = _RankSpec(
                str(model_path), config, dtype, rank, self.store.port, os.getpid(),
                num_blocks, max_model_len,
            )  # fmt: skip
            proc = ctx.Process(target=_rank_main, args=(spec,), name=f"sluice-rank-{rank}")
            proc.daemon = True
            proc.start()
            self.processes.append(proc)
        device = rank_device(config.device, 0)
        self.group: RankGroup | None = None
        try:
            self.group = RankGroup.join(self.store, 0, tp, device, self.timeout_s)
        except Exception as exc:
            self.close()
            raise RankFailure(f"tensor-parallel ranks did not start: {exc}") from exc

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def wait_ready(self) -> None:
        """Block until every helper has built its shard; RankFailure if one fails or dies."""
        pending = set(range(1, len(self.processes) + 1))
        while pending:
            for rank in sorted(pending):
                if self.store.check([f"error/{rank}"]):
                    error = self.store.get(f"error/{rank}").decode()
                    self._fail(f"rank {rank} failed to load: {error}")
                if self.store.check([f"ready/{rank}"]):
                    pending.discard(rank)
            self.check_alive()
            time.sleep(0.02)
        self.ready = True

    def check_alive(self) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)
        dead = [(r, p.exitcode) for r, p in enumerate(self.processes, 1) if p.exitcode is not None]
        if dead:
            self._fail(", ".join(f"rank {r} exited with code {code}" for r, code in dead))

    def _fail(self, reason: str) -> NoReturn:
        self.failure = f"tensor-parallel replica is down: {reason}"
        raise RankFailure(self.failure)

    def run(self, command: Command, local: Callable[[], Any] | None = None) -> Any:
        """Broadcast `command`, then run rank 0's part of it; RankFailure on any failure."""
        with self.lock:
            self.check_alive()
            try:
                self.group.send(command, self.timeout_s)
                return local() if local is not None else None
            except Exception as exc:
                self._explain_failure(command, exc)

    def _explain_failure(self, command: Command, exc: Exception) -> NoReturn:
        time.sleep(0.1)  # let a dying helper's exit code show up in the message
        try:
            self.check_alive()
        except RankFailure as failure:
            raise failure from exc
        self._fail(f"{command[0]!r} failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop the helpers (politely, then by signal) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        with self.lock:  # after a running step, which ends within tp_timeout_s
            healthy = self.ready and self.failure is None
            healthy = healthy and all(p.exitcode is None for p in self.processes)
            if healthy and self.group is not None:
                with contextlib.suppress(Exception):  # a helper died meanwhile: killed below
                    self.group.send(("stop",), self.timeout_s)
        for proc in self.processes:
            proc.join(timeout=5 if healthy else 0)
            if proc.exitcode is None:
                proc.terminate()
                proc.join(timeout=2)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        if dist.is_initialized():
            dist.destroy_process_group()


class TPRunner:
    """Rank 0's model runner: broadcasts each step's work, then runs its own shard."""

    def __init__(self, runner: ModelRunner, ranks: HelperRanks, adapters: AdapterManager) -> None:
        self.local = runner
        self.ranks = ranks
        self.adapters = adapters

    @property
    def model(self) -> torch.nn.Module:
        return self.local.model

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.local.kv_caches

    @property
    def compiled(self) -> CompiledStep | None:
        return self.local.compiled

    @property
    def last_inputs_s(self) -> float:
        return self.local.last_inputs_s

    def warm_up(self) -> bool:
        """Every rank compiles its shard's graphs (their all-reduces run in step)."""
        return self.ranks.run(("warm_up",), self.local.warm_up)

    def forward(self, seqs: list[ScheduledSeq], rows_to_sample: list[int]) -> torch.Tensor:
        """As `ModelRunner.forward`; every rank computes the same rows of its shard."""
        command = ("step", seqs, rows_to_sample, list(self.adapters.slots))
        return self.ranks.run(command, lambda: self.local.forward(seqs, rows_to_sample))
