"""GPU readiness without a GPU: every Triton kernel, with the launch constants the
runtime really uses, compiled ahead of time by Triton's own compiler for Hopper
(sm_90: H100/H200) and Ampere (sm_80) — through TTIR, TTGIR, LLVM IR and PTX to a
cubin with the ptxas that ships in the triton wheel. The interpreter tests check the
kernels' arithmetic; only the real compiler checks what it requires (power-of-two
ranges, `tl.dot` operands of at least 16 in each dimension, dtypes it can lower,
shared memory that fits the SM)."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gpu_runtime import triton_attention, triton_lora  # noqa: E402

# Shared memory one block may use (bytes): H100/H200 228 KiB less 1 KiB reserved, A100 163 KiB.
TARGETS = {90: 227 * 1024, 80: 163 * 1024}
TORCH_TO_TRITON = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="ahead-of-time compilation is not interpreted")


def _compile(kernel, pointer_types: dict[str, str], scalars: dict[str, str],
             constants: dict[str, object], capability: int):
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        else:
            signature[name] = scalars.get(name, "i32")
    constexprs = {(kernel.arg_names.index(k),): v for k, v in constants.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32))


def _fits(compiled, capability: int) -> None:
    assert compiled.asm["cubin"], "ptxas made no cubin"
    assert f".target sm_{capability}" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= TARGETS[capability], compiled.metadata.shared


@pytest.mark.parametrize("capability", sorted(TARGETS))
@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size"), [
    ("bfloat16", 32, 8, 128, 16),  # Llama-3-8B
    ("float16", 9, 3, 64, 16),  # SmolLM-135M
    ("bfloat16", 14, 2, 64, 32),  # Qwen2-0.5B, larger KV blocks
    ("float32", 4, 4, 80, 16),  # no GQA, a head_dim that is not a power of two
])
def test_paged_attention_compiles_for_the_gpu(capability, dtype, num_heads, num_kv_heads,
                                              head_dim, block_size) -> None:
    kernel_dtype = TORCH_TO_TRITON[dtype]
    constants = triton_attention.launch_constants(num_heads, num_kv_heads, head_dim,
                                                  block_size)
    compiled = _compile(
        triton_attention._paged_attention_kernel,
        {"q_ptr": f"*{kernel_dtype}", "k_ptr": f"*{kernel_dtype}",
         "v_ptr": f"*{kernel_dtype}", "o_ptr": f"*{kernel_dtype}", "bt_ptr": "*i32",
         "seq_idx_ptr": "*i32", "ctx_len_ptr": "*i32"},
        {"scale": "fp32"}, constants, capability)
    _fits(compiled, capability)


@pytest.mark.parametrize("capability", sorted(TARGETS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("rank", [8, 64])
def test_lora_kernels_compile_for_the_gpu(capability, dtype, rank) -> None:
    import torch

    torch_dtype = getattr(torch, dtype)
    kernel_dtype = TORCH_TO_TRITON[dtype]
    shrink = _compile(
        triton_lora._shrink_kernel,
        {"x_ptr": f"*{kernel_dtype}", "a_ptr": f"*{kernel_dtype}", "out_ptr": "*fp32",
         "seg_starts_ptr": "*i32", "seg_slots_ptr": "*i32"},
        {}, triton_lora.shrink_constants(rank, torch_dtype), capability)
    _fits(shrink, capability)
    expand = _compile(
        triton_lora._expand_kernel,
        {"xa_ptr": "*fp32", "b_ptr": f"*{kernel_dtype}", "y_ptr": f"*{kernel_dtype}",
         "seg_starts_ptr": "*i32", "seg_slots_ptr": "*i32"},
        {}, triton_lora.expand_constants(rank, torch_dtype), capability)
    _fits(expand, capability)


def test_the_compiler_refuses_what_the_interpreter_lets_pass() -> None:
    """The check has teeth: a `tl.dot` whose inner dimension is under 16 runs in the
    interpreter (and gives the right numbers there) but is not a GPU kernel."""
    import torch

    constants = dict(triton_lora.shrink_constants(8, torch.bfloat16), BLOCK_K=8)
    with pytest.raises(triton.CompilationError) as info:
        _compile(triton_lora._shrink_kernel,
                 {"x_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*fp32",
                  "seg_starts_ptr": "*i32", "seg_slots_ptr": "*i32"},
                 {}, constants, 90)
    assert "K >= 16" in repr(info.value.__cause__)
