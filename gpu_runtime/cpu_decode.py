"""All-decode steps on the CPU by one C call over all decoder layers.

At batch 1 a SmolLM2 decode step through torch was 28-30 ms, of which the
products' kernels took ~12: the rest was ~25 torch ops per layer, each a
dispatch, an allocation and (for the oneDNN products) a primitive set up again,
while the second thread spun waiting (perf: 58 % of its samples in libgomp's
wait). `native/decode_layers.c` runs such a step from its token ids in one
OpenMP region: the embedding's rows, every layer (see its header for the phases,
the products and where values are rounded), the final norm and, as a decode step
samples every row, the LM head's float32 logits and their argmax (which sampling
takes while nothing changed the logits: `take_argmax`). The LM head of the rows
other steps sample (prefill chunks, up to `MAX_ROWS`) runs on the same products
(`NativeDecoder.logits`), and the runtime's other argmaxes run on the library's
(`NativeDecoder.argmax`); the rest of sampling stays in torch.

Its products read a weight layout of their own (`blocked`: blocks of 32 output
rows, each one contiguous stream), made at load from the checkpoint's rows
before the oneDNN packing (`cpu_linear.py`), which keeps serving prefill chunks:
a second copy of the projection weights and of the LM head (the memory planner
counts it; `RuntimeConfig.cpu_native_decode=False` saves it). Quantized weights are
not copied: their bytes move. Either way every weight a step streams lives in one
mapping on transparent huge pages (`host_memory.HugePageArena`): in the heap, with 4
KiB pages, the 1B-class Q4_K_M file's q/k/v and gate/up products read ~24 GB/s
against ~30 on huge pages.

Measured on SmolLM2-135M, 2 threads, AMD EPYC with avx512_bf16, whole decode
steps against the torch path (packed oneDNN products, the native attention):
float32 1.9x at batch 1, 1.7x with 8 sequences, 1.2-1.8x with 16 to 128;
bfloat16 2.3x, 2.0x, 1.3-1.7x in-process; 2.9x, 2.5x, 1.3x at 1, 8 and 32 in
`sluice bench cpu`, which measures it beside llama.cpp (benchmarks/README.md).
With the elementwise phases vectorised, attention by blocks of 16 keys and the KV
cache on huge pages (2026-12-04): 2.4-2.5x, 2.2-2.5x, 1.5-1.7x there.

A step takes this path when every row is a decode, there are at most
`MAX_ROWS`, no row uses a LoRA adapter, and the runtime was built with it. The
runtime is built with it on the CPU in float32 (AVX-512 or AVX2, cpu_attention.py),
or in bfloat16 where the CPU has AVX512-BF16, when the native decode attention loaded (same library,
cpu_attention.py), the step is not compiled, the model is one unquantized rank,
every projection is a plain `Linear` (or LoRA over one: not FP8, not a
tensor-parallel shard) and every product's input width is even; otherwise the
reason is logged and the torch path serves.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.config import ModelConfig, RuntimeConfig
from gpu_runtime.context import StepContext
from gpu_runtime.host_memory import HugePageArena, release_free_heap
from gpu_runtime.layers import Linear
from gpu_runtime.lora import LoraLinear
from gpu_runtime.native_abi import Proj as _Proj
from gpu_runtime.quantized import QuantizedEmbedding, QuantizedLinear

log = logging.getLogger(__name__)

MAX_ROWS = 128  # rows of a decode step it takes (decode_layers.c; measured faster to 128)
# ... in bfloat16 where oneDNN multiplies on AMX tiles: past ~20 rows its products beat
# the kernel's AVX512-BF16 ones (SmolLM2 on a 2-core Xeon, bfloat16 tok/s native / torch
# decode: 1.66x at 8 rows, 1.08x at 16, 0.87x at 24, 0.75x at 32, 0.43x at 128).
AMX_BF16_ROWS = 20
BLOCK_ROWS = 32  # output rows per block of the kernel's weight layout
WIDTH_MULTIPLE = 2  # a product's input width: whole bfloat16 pairs
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p),
                ("kv", ctypes.c_void_p), ("window", ctypes.c_int64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
        "block_size", "num_blocks", "bf16")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float),
                                                ("final_norm", ctypes.c_void_p),
                                                ("embed", ctypes.c_void_p),
                                                ("vocab", ctypes.c_int64), ("lm_head", _Proj),
                                                ("embed_q", _Proj), ("qscratch", ctypes.c_void_p)]


def _blocked_view(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> a (strided) view of blocks of 32 output rows, each one stream:
    [ceil(N / 32), K / 2, 32, 2] in bfloat16 (the pairs of the bf16 dot product),
    [ceil(N / 32), K, 32] in float32; rows past N zero."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, (-n) % BLOCK_ROWS))
    if weight.dtype == torch.bfloat16:
        return padded.view(-1, BLOCK_ROWS, k // 2, 2).transpose(1, 2)
    return padded.view(-1, BLOCK_ROWS, k).transpose(1, 2)


def blocked(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's float layout of [N, K] (`_blocked_view`), contiguous."""
    return _blocked_view(weight).contiguous()


@dataclass(slots=True)
class _Projection:
    weight: torch.Tensor  # blocked, or quantized.py's packed bytes
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    qtype: int = 0
    block_qtypes: torch.Tensor | None = None  # [blocks] int64 (parts of different formats)
    block_offsets: torch.Tensor | None = None  # [blocks] int64 byte offsets
    copied: bool = True  # a copy of the model's weights (the float layout), not shared

    def struct(self) -> _Proj:
        bias = self.bias.data_ptr() if self.bias is not None else None
        extra = [t.data_ptr() if t is not None else None
                 for t in (self.block_qtypes, self.block_offsets)]
        return _Proj(self.weight.data_ptr(), bias, self.out_features, self.in_features,
                     self.qtype, *extra)


def _plain(module: nn.Module) -> Linear | QuantizedLinear | None:
    base = module.base if isinstance(module, LoraLinear) else module
    return base if type(base) in (Linear, QuantizedLinear) else None


def _layout(parts: list[Linear | QuantizedLinear]) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the kernel's weight for one product over `parts`' rows."""
    if isinstance(parts[0], QuantizedLinear):
        return (sum(p.packed.numel() for p in parts),), torch.uint8
    rows = sum(p.weight.shape[0] for p in parts)
    k, dtype = parts[0].weight.shape[1], parts[0].weight.dtype
    blocks = -(-rows // BLOCK_ROWS)
    if dtype == torch.bfloat16:
        return (blocks, k // 2, BLOCK_ROWS, 2), dtype
    return (blocks, k, BLOCK_ROWS), dtype


def _projection(parts: list[Linear | QuantizedLinear], arena: HugePageArena) -> _Projection:
    """One product over the parts' rows (q/k/v, gate/up), its weight in `arena`."""
    if isinstance(parts[0], QuantizedLinear):
        return _quantized_projection(parts, arena)
    weight = torch.cat([p.weight.data for p in parts]) if len(parts) > 1 else parts[0].weight.data
    bias = None
    if parts[0].bias is not None:
        bias = torch.cat([p.bias.data for p in parts]).contiguous()
    out = arena.empty(*_layout(parts))
    out.copy_(_blocked_view(weight))
    return _Projection(out, bias, weight.shape[0], weight.shape[1])


def _quantized_projection(parts: list[QuantizedLinear], arena: HugePageArena) -> _Projection:
    """One product over the parts' rows: their packed blocks joined in the arena, where
    each part then reads its own view (the model's bytes move there: no second copy)."""
    first = parts[0]
    joined = arena.empty(*_layout(parts))
    torch.cat([p.packed.data for p in parts], out=joined)
    qtypes, offsets, at = [], [], 0
    for part in parts:
        blocks = -(-part.out_features // BLOCK_ROWS)
        size = part.packed.numel() // blocks
        qtypes += [part.qtype] * blocks
        offsets += [at + i * size for i in range(blocks)]
        part.packed = nn.Parameter(joined[at : at + part.packed.numel()], requires_grad=False)
        at += part.packed.numel()
    uniform = len({p.qtype for p in parts}) == 1
    return _Projection(
        joined, None, sum(p.out_features for p in parts), first.in_features, first.qtype,
        None if uniform else torch.tensor(qtypes, dtype=torch.int64),
        None if uniform else torch.tensor(offsets, dtype=torch.int64), copied=False)


def _cpu_has_avx512_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported())
    except AttributeError:
        return False


def why_not_native_decode(model: nn.Module, config: ModelConfig, device: torch.device,
                          dtype: torch.dtype, compile: bool) -> str | None:
    """None when `model`'s decode steps of few rows can run on the kernel, else why.
    Call before `pack_cpu_linears` (it reads the plain projections)."""
    from gpu_runtime.cpu_attention import why_not_native

    reason = why_not_native(device, dtype, config.head_dim,
                            config.num_heads // config.num_kv_heads, compile)
    if reason is not None:
        return f"no native decode attention: {reason}"
    if dtype == torch.bfloat16 and not _cpu_has_avx512_bf16():
        return "bfloat16 products need AVX512-BF16, which this CPU lacks"
    widths = {"hidden_size": config.hidden_size,
              "heads x head_dim": config.num_heads * config.head_dim,
              "intermediate_size": config.intermediate_size}
    for name, width in widths.items():
        if width % WIDTH_MULTIPLE:
            return f"{name} {width} is not a multiple of {WIDTH_MULTIPLE}"
    if type(model.model.embed_tokens) not in (nn.Embedding, QuantizedEmbedding):
        return f"the embedding is a {type(model.model.embed_tokens).__name__}, not nn.Embedding"
    if type(model.lm_head) not in (Linear, QuantizedLinear):
        return f"the LM head is a {type(model.lm_head).__name__}, not a plain Linear"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for parent, names in ((attn, ATTENTION_PROJECTIONS), (mlp, MLP_PROJECTIONS)):
            for name in names:
                if _plain(getattr(parent, name)) is None:
                    kind = type(getattr(parent, name)).__name__
                    return f"{name} is a {kind}, not a plain Linear"
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parts = [_plain(getattr(attn if name[0] in "qkv" else mlp, name)) for name in group]
            kinds = {type(p) for p in parts}
            if len(kinds) > 1:
                return f"{'/'.join(group)} mix float and quantized weights"
            if (QuantizedLinear in kinds and len(parts) > 1
                    and any(p.out_features % BLOCK_ROWS for p in parts)):
                return f"{'/'.join(group)}: quantized parts need rows in multiples of {BLOCK_ROWS}"
    return None


class NativeDecoder:
    """The decoder layers' weights in the kernel's layout, and the call over them."""

    def __init__(self, model: nn.Module, config: ModelConfig) -> None:
        from gpu_runtime.cpu_attention import load

        kernel, reason = load()
        if kernel is None:
            raise RuntimeError(f"the native kernels are not loaded: {reason}")
        fn = kernel.library.sluice_decode_layers
        fn.restype = ctypes.c_int
        # model, layers, x, rows; token ids, positions, slots, block tables, their width;
        # lens, rope, rope length, work, threads, out, logits, their argmax (decode_layers.c)
        fn.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        self.fn = fn
        project = kernel.library.sluice_project
        project.restype = ctypes.c_int
        project.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                            ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self.project_fn = project
        argmax = kernel.library.sluice_argmax
        argmax.restype = ctypes.c_int
        argmax.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int]
        self.argmax_fn = argmax
        self.config = config
        self.dtype = model.model.norm.weight.dtype  # the activations' (a quantized table has none)
        # the most rows of a step it serves (larger steps: the torch path)
        self.max_rows = (AMX_BF16_ROWS if self.dtype == torch.bfloat16
                         and onednn_multiplies_bf16_on_amx() else MAX_ROWS)
        groups = []  # per layer: the parts of its q/k/v, o, gate/up and down products
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            plain = {name: _plain(getattr(attn, name)) for name in ATTENTION_PROJECTIONS}
            plain |= {name: _plain(getattr(mlp, name)) for name in MLP_PROJECTIONS}
            groups.append({"qkv": [plain["q_proj"], plain["k_proj"], plain["v_proj"]],
                           "o": [plain["o_proj"]],
                           "gate_up": [plain["gate_proj"], plain["up_proj"]],
                           "down": [plain["down_proj"]]})
        # Every weight a step streams, in one huge-page arena (host_memory.py): the
        # quantized bytes move there, the float layout is made there.
        self.arena = HugePageArena(HugePageArena.size_of(
            [_layout(parts) for g in groups for parts in g.values()] + [_layout([model.lm_head])]))
        self.layers: list[dict[str, object]] = []
        for layer, g in zip(model.model.layers, groups, strict=True):
            self.layers.append({
                **{name: _projection(parts, self.arena) for name, parts in g.items()},
                "norm1": layer.input_layernorm.weight.data,
                "norm2": layer.post_attention_layernorm.weight.data,
                "window": layer.self_attn.window or 0,
            })  # fmt: skip
        self.final_norm = model.model.norm.weight.data
        embedding = model.model.embed_tokens
        self.embed = embedding.weight.data if isinstance(embedding, nn.Embedding) else None
        # The LM head too (tied: a copy of the embedding rows, or the same quantized
        # bytes): a step samples a few rows.
        self.lm_head = _projection([model.lm_head], self.arena)
        self.lm_head_struct = self.lm_head.struct()
        # after the LM head's move: a tied quantized table is its bytes
        self.embed_q = (embedding.table.struct() if isinstance(embedding, QuantizedEmbedding)
                        else _Proj())
        release_free_heap()  # the quantized bytes' old home, and the staging copies
        # the quantized products' input rows (quantized.py): the widest input, MAX_ROWS rows
        widest = max(config.hidden_size, config.intermediate_size,
                     config.num_heads * config.head_dim)
        self.qscratch = torch.empty(
            kernel.library.sluice_quant_scratch_bytes(MAX_ROWS, widest)
            if hasattr(kernel.library, "sluice_quant_scratch_bytes") else 0, dtype=torch.uint8)
        c = config
        self.work_per_row = (c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                             + c.num_heads * c.head_dim + 3 * c.intermediate_size)
        self.model_struct: _Model | None = None
        self.layer_structs: ctypes.Array[_Layer] | None = None
        # The last decode step's logits and their argmax, which the kernel's call also
        # returns (`take_argmax`).
        self._greedy: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def extra_bytes(self) -> int:
        parts = [p for layer in self.layers for p in layer.values() if isinstance(p, _Projection)]
        return sum(p.weight.numel() * p.weight.element_size() for p in [*parts, self.lm_head]
                   if p.copied)

    def bind(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        """Point the layers at their KV caches ([2, num_blocks, block_size, n_kv, D])."""
        c = self.config
        num_blocks = kv_caches[0].shape[1]
        self.model_struct = _Model(
            c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, block_size, num_blocks, DTYPES[self.dtype],
            c.rms_norm_eps, c.head_dim**-0.5, self.final_norm.data_ptr(),
            None if self.embed is None else self.embed.data_ptr(), c.vocab_size,
            self.lm_head_struct, self.embed_q, self.qscratch.data_ptr())  # fmt: skip
        structs = (_Layer * len(self.layers))()
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            structs[i] = _Layer(
                layer["qkv"].struct(), layer["o"].struct(), layer["gate_up"].struct(),
                layer["down"].struct(), layer["norm1"].data_ptr(), layer["norm2"].data_ptr(),
                kv.data_ptr(), layer["window"])  # fmt: skip
        self.layer_structs = structs

    def __call__(self, input_ids: torch.Tensor, ctx: StepContext, rope: torch.Tensor
                 ) -> torch.Tensor:
        """input_ids: [rows] int64 -> the last layer's output through the model's final
        norm, [rows, hidden]; also every row's float32 logits into `ctx.native_logits`
        when the step gives it ([rows, vocab]), and their argmax (`take_argmax`)."""
        rows = input_ids.shape[0]
        tables, logits = ctx.decode_block_tables, ctx.native_logits
        greedy = None if logits is None else torch.empty(rows, dtype=torch.int64)
        self._greedy = None
        # one allocation: the residual stream, the output and the phases' scratch
        hidden = self.config.hidden_size
        work = torch.empty(rows * (self.work_per_row + 2 * hidden), dtype=self.dtype)
        x = work[: rows * hidden].view(rows, hidden)
        out = work[rows * hidden : 2 * rows * hidden].view(rows, hidden)
        rc = self.fn(
            ctypes.addressof(self.model_struct), ctypes.addressof(self.layer_structs),
            x.data_ptr(), rows, input_ids.data_ptr(), ctx.positions.data_ptr(),
            ctx.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1],
            ctx.decode_lens.data_ptr(), rope.data_ptr(), rope.shape[0],
            work[2 * rows * hidden :].data_ptr(), torch.get_num_threads(), out.data_ptr(),
            None if logits is None else logits.data_ptr(),
            None if greedy is None else greedy.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError("the native decode step failed: " + (
                "a token id, position or cache slot out of range" if rc == -1
                else "attention could not read a row (no keys or past its table)"))
        if logits is not None:
            self._greedy = (logits, greedy)
        return out

    def take_argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The argmax of `logits` as the step that wrote them computed it (int64 [rows],
        `argmax`'s rule), when they are the last decode step's logits; else None. Only
        for logits not changed since: the caller knows (inference tensors keep no
        version counter). Right after a step a call into torch runs cold: `argmax`'s
        checks and allocation took 0.1 ms at batch 1, the kernel's row 0.013 ms."""
        fused, self._greedy = self._greedy, None
        return fused[1] if fused is not None and logits is fused[0] else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows <= MAX_ROWS, hidden] -> float32 logits [rows, vocab] (rounded to
        the model's dtype first, as the torch path's LM head output is; the kernel writes
        them as float32, so no second pass converts them)."""
        hidden = hidden.contiguous()
        out = torch.empty((hidden.shape[0], self.lm_head.out_features), dtype=torch.float32)
        rc = self.project_fn(ctypes.addressof(self.lm_head_struct), hidden.data_ptr(),
                             hidden.shape[0], out.data_ptr(), DTYPES[self.dtype],
                             torch.get_num_threads(), self.qscratch.data_ptr())
        if rc != 0:
            raise RuntimeError(f"the native LM head takes 1 to {MAX_ROWS} rows, not "
                               f"{hidden.shape[0]}")
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(dim=-1)` of [rows, vocab] float32 on the CPU, torch's rule (the
        first of equal maxima, a NaN above all), by the kernel: torch's ran at ~1 G
        values/s here, 1.2 ms of a 32-row SmolLM2 step. Other inputs go to torch."""
        if (logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
                or not logits.is_contiguous() or logits.shape[0] == 0):
            return logits.argmax(dim=-1)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        if self.argmax_fn(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
                          torch.get_num_threads()) != 0:
            return logits.argmax(dim=-1)
        return out


def onednn_multiplies_bf16_on_amx() -> bool:
    """Whether oneDNN's bfloat16 products run on AMX tiles here: the CPU has them, the
    OS lets this process use them (torch asks for the tile state as oneDNN does; a VM
    that refuses it gets False), and `ONEDNN_MAX_CPU_ISA` does not cap oneDNN below AMX."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap and cap not in ("ALL", "DEFAULT") and "AMX" not in cap:
        return False
    try:
        return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
    except (AttributeError, RuntimeError):  # a torch without these probes
        return False


def why_not_for_config(config: RuntimeConfig, device: torch.device,
                       dtype: torch.dtype) -> str | None:
    """None when a runtime of `config` may decode natively, else why (before the model
    is read: `why_not_native_decode` checks the model)."""
    if not config.cpu_native_decode:
        return "cpu_native_decode is off"
    if not config.cpu_native_attention:
        return "cpu_native_attention is off (the step runs that kernel)"
    if device.type != "cpu":
        return f"the device is {device.type}"
    if dtype not in DTYPES:
        return f"the kernel computes in float32 or bfloat16, not {dtype}"
    if config.compile:
        return "the decode step is compiled"
    if config.quantization != "none":
        return f"the weights are {config.quantization}"
    if config.tp != 1:
        return f"the model is split over {config.tp} ranks"
    return None


def decodes_natively(config: RuntimeConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a runtime of `config` may hold the kernel's weight copy (the memory
    planner's question; `build_shard` decides from the model itself)."""
    return why_not_for_config(config, device, dtype) is None
