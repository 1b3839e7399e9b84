"""Decode steps of a few rows by one C call over all layers (`gpu_runtime.cpu_decode`).

A runtime on it is checked against transformers and against the torch path
(`cpu_native_decode=False`) on the same checkpoints, in float32 and bfloat16; the
model, LoRA and session parity tests run on it too, as it is the CPU default for
decode steps of up to 8 rows.
"""

from __future__ import annotations

import pytest
import torch

from gpu_runtime import SamplingParams, StepPlan
from gpu_runtime.cpu_decode import (
    AMX_BF16_ROWS,
    MAX_ROWS,
    blocked,
    onednn_multiplies_bf16_on_amx,
    why_not_native_decode,
)
from gpu_runtime.planner import MemoryRequest, weight_bytes_per_device
from tests.parity.native_kernels import needs_native_kernels
from tests.parity.test_model_parity import VARIANTS
from tests.runtime_support import (
    assert_ragged_run_matches_hf,
    assert_same_ragged_run,
    make_hf_checkpoint,
    make_runtime,
    ragged_run,
    random_prompt,
)

CPU = torch.device("cpu")
pytestmark = needs_native_kernels


def _count_native_steps(rt) -> list[int]:
    """Wraps the runtime's decoder: the row count of every step it ran. Each such step
    samples every row, so each must end with the LM head's logits in the same call."""
    decoder, rows = rt.runner.native_decoder, []
    original = decoder.__call__

    class Counting(type(decoder)):
        def __call__(self, input_ids, ctx, rope):
            rows.append(input_ids.shape[0])
            assert ctx.native_logits is not None
            assert ctx.native_logits.shape == (input_ids.shape[0], self.lm_head.out_features)
            return original(input_ids, ctx, rope)

    decoder.__class__ = Counting
    return rows


@pytest.mark.parametrize("variant", ["gqa", "tied_mha_bias", "llama3_rope_head_dim",
                                     "mistral_window", "qwen2_mixed_window"])
def test_native_decode_matches_transformers_and_the_torch_path(variant, tmp_path) -> None:
    path, hf = make_hf_checkpoint(tmp_path, **VARIANTS[variant])
    rt = make_runtime(path, device="cpu")
    assert rt.runner.native_decoder is not None
    rows = _count_native_steps(rt)
    native = ragged_run(rt)
    assert len(rows) >= 10 and max(rows) == 7  # the all-decode steps, of 1 to 7 rows
    assert_ragged_run_matches_hf(hf, native, tol=2e-4)
    off = make_runtime(path, device="cpu", cpu_native_decode=False)
    assert off.runner.native_decoder is None
    assert_same_ragged_run(native, ragged_run(off), tol=1e-4)


@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="no AVX512-BF16")
@pytest.mark.parametrize("variant", ["gqa", "tied_mha_bias", "qwen2_mixed_window"])
def test_native_decode_in_bfloat16_matches_the_torch_path(variant, tmp_path) -> None:
    """bfloat16: the same greedy tokens as the torch path (the parity configs' logits are
    peaky), logits within bfloat16's rounding of the torch path's (the same rounding
    points, other summation orders: a few units of 2^-8 of the logits' scale). Against
    transformers in bfloat16: test_bf16_cpu.py, which runs on this path."""
    path, _ = make_hf_checkpoint(tmp_path, **VARIANTS[variant])
    native_rt = make_runtime(path, device="cpu", dtype="bfloat16")
    assert native_rt.runner.native_decoder is not None
    rows = _count_native_steps(native_rt)
    native = ragged_run(native_rt)
    assert rows
    torch_path = ragged_run(make_runtime(path, device="cpu", dtype="bfloat16",
                                         cpu_native_decode=False))
    assert native[0] == torch_path[0]
    for s in native[2]:
        got, want = torch.stack(native[1][s]), torch.stack(torch_path[1][s])
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= 0.05 * scale, s


def test_more_rows_than_the_kernel_takes_go_the_torch_way(tmp_path) -> None:
    path, _ = make_hf_checkpoint(tmp_path)
    prompts = {f"s{i}": random_prompt(4 + i % 9, 30 + i) for i in range(MAX_ROWS + 1)}

    def run(**overrides):
        rt = make_runtime(path, device="cpu", kv_cache_len=16384, **overrides)
        rows = _count_native_steps(rt) if rt.runner.native_decoder is not None else []
        tokens = {s: [] for s in prompts}
        for s, p in prompts.items():
            rt.add_sequence(s, p, SamplingParams(max_tokens=8, ignore_eos=True))
        for step in range(6):  # MAX_ROWS + 1 decodes at steps 1 and 2, one fewer after
            plan = {s: q.num_uncomputed for s, q in rt.sequences.items()}
            for o in rt.execute(StepPlan(plan)).outputs:
                tokens[o.seq_id].append(o.token_id)
            if step >= 2:
                rt.remove_sequence(sorted(rt.sequences)[0])
        return tokens, rows

    native, rows = run()
    torch_path, _ = run(cpu_native_decode=False)
    assert rows == [MAX_ROWS, MAX_ROWS - 1, MAX_ROWS - 2]  # not the larger steps
    assert native == torch_path


def test_the_amx_probe_follows_the_cpu_and_onednn_s_cap(monkeypatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert onednn_multiplies_bf16_on_amx() == bool(
        torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not onednn_multiplies_bf16_on_amx()


@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="no AVX512-BF16")
def test_bfloat16_steps_past_the_decoder_s_rows_go_the_torch_way(tmp_path) -> None:
    """Where oneDNN multiplies bfloat16 on AMX, steps of more than AMX_BF16_ROWS rows
    take the torch path (faster there); elsewhere the kernel serves up to MAX_ROWS. A
    float32 decoder always takes MAX_ROWS."""
    path, _ = make_hf_checkpoint(tmp_path)
    assert make_runtime(path, device="cpu").runner.native_decoder.max_rows == MAX_ROWS
    rt = make_runtime(path, device="cpu", dtype="bfloat16")
    limit = rt.runner.native_decoder.max_rows
    assert limit == (AMX_BF16_ROWS if onednn_multiplies_bf16_on_amx() else MAX_ROWS)
    rows = _count_native_steps(rt)
    prompts = {f"s{i}": random_prompt(4 + i % 5, 60 + i) for i in range(AMX_BF16_ROWS + 4)}

    def run(rt) -> dict[str, list[int]]:
        tokens = {s: [] for s in prompts}
        for s, p in prompts.items():
            rt.add_sequence(s, p, SamplingParams(max_tokens=4, ignore_eos=True))
        while rt.sequences:
            plan = {s: q.num_uncomputed for s, q in rt.sequences.items()}
            for o in rt.execute(StepPlan(plan)).outputs:
                tokens[o.seq_id].append(o.token_id)
        return tokens

    native = run(rt)
    assert rows == ([] if limit < len(prompts) else [len(prompts)] * 3)
    assert native == run(make_runtime(path, device="cpu", dtype="bfloat16",
                                      cpu_native_decode=False))


def test_a_step_it_cannot_serve_is_an_error_not_garbage(tmp_path) -> None:
    from gpu_runtime.runner import ScheduledSeq

    path, _ = make_hf_checkpoint(tmp_path)
    rt = make_runtime(path, device="cpu")
    rt.add_sequence("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    rt.execute(StepPlan({"a": 3}))
    runner, decoder, seq = rt.runner, rt.runner.native_decoder, rt.sequences["a"]
    step = ScheduledSeq([seq.token_ids[-1]], seq.num_computed_tokens, list(seq.block_table))
    ids, ctx, _ = runner.build_context([step])
    assert ctx.native_decoder is decoder
    decoder(ids, ctx, runner.model.rope)  # as built: it serves
    before = [kv.clone() for kv in runner.kv_caches]
    vocab = runner.model.config.vocab_size
    for bad_ids, field, value in ((ids, "slot_mapping", 1 << 40),
                                  (ids, "positions", runner.max_model_len + 5),
                                  (torch.tensor([vocab]), "positions", None),
                                  (torch.tensor([-1]), "positions", None)):
        good = getattr(ctx, field)
        if value is not None:
            setattr(ctx, field, torch.tensor([value]))
        with pytest.raises(RuntimeError, match="out of range"):
            decoder(bad_ids, ctx, runner.model.rope)
        setattr(ctx, field, good)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    ctx.decode_lens = torch.tensor([0])  # a row without keys
    with pytest.raises(RuntimeError, match="could not read a row"):
        decoder(ids, ctx, runner.model.rope)


def test_blocked_layout_holds_every_row_once() -> None:
    weight = torch.randn(41, 64)  # 41 rows: the last block padded
    b = blocked(weight)
    assert b.shape == (2, 64, 32)
    plain = b.transpose(1, 2).reshape(64, 64)
    assert torch.equal(plain[:41], weight) and not plain[41:].any()
    weight = weight.bfloat16()
    b = blocked(weight)
    assert b.shape == (2, 32, 32, 2)
    plain = b.transpose(1, 2).reshape(64, 64)
    assert torch.equal(plain[:41], weight) and not plain[41:].any()


def test_no_native_decode_where_it_cannot_serve(tmp_path) -> None:
    path, _ = make_hf_checkpoint(tmp_path, intermediate_size=75)
    rt = make_runtime(path, device="cpu")
    assert rt.runner.native_decoder is None
    config = rt.model_config
    assert "intermediate_size 75" in why_not_native_decode(
        rt.runner.model, config, CPU, torch.float32, compile=False)
    assert "compiled" in why_not_native_decode(rt.runner.model, config, CPU, torch.float32,
                                               compile=True)
    assert make_runtime(path, device="cpu", dtype="bfloat16", quantization="fp8",
                        cpu_prepack=False).runner.native_decoder is None
    from gpu_runtime.config import RuntimeConfig
    from gpu_runtime.cpu_decode import why_not_for_config

    assert why_not_for_config(RuntimeConfig(), CPU, torch.bfloat16) is None
    assert "off" in why_not_for_config(RuntimeConfig(cpu_native_decode=False), CPU, torch.float32)
    assert "2 ranks" in why_not_for_config(RuntimeConfig(tp=2), CPU, torch.float32)
    assert "fp8" in why_not_for_config(RuntimeConfig(quantization="fp8"), CPU, torch.bfloat16)
    path2, _ = make_hf_checkpoint(tmp_path / "b")
    assert make_runtime(path2, device="cpu", cpu_native_decode=False).runner.native_decoder is None
    assert make_runtime(path2, device="cpu", cpu_native_attention=False
                        ).runner.native_decoder is None


def test_the_planner_counts_the_weight_copy(tmp_path) -> None:
    path, _ = make_hf_checkpoint(tmp_path)
    rt = make_runtime(path, device="cpu")
    config = rt.model_config
    plain = weight_bytes_per_device(config, MemoryRequest(torch.float32, 4096))
    with_copy = weight_bytes_per_device(config, MemoryRequest(torch.float32, 4096,
                                                              decode_copy=True))
    assert with_copy - plain >= rt.runner.native_decoder.extra_bytes


def test_the_kernels_argmax_is_torchs(tmp_path) -> None:
    """Greedy rows pick by the kernel's argmax: the same index as torch.argmax for ties
    (the first), rows of -inf, NaN (torch ranks it above every number), tails past the
    last 16 values, more rows than threads; and a runtime samples with it."""
    path, _ = make_hf_checkpoint(tmp_path)
    rt = make_runtime(path, device="cpu")
    decoder = rt.runner.native_decoder
    assert rt._argmax == decoder.argmax
    gen = torch.Generator().manual_seed(7)
    for rows, cols in ((1, 1), (3, 15), (5, 16), (33, 49_157), (128, 1_000)):
        x = torch.randn(rows, cols, generator=gen)
        top = x.max() + 1
        x[::2, [cols // 2, cols - 1]] = top  # even rows: two equal maxima, the first wins
        x[1::2, cols - 1] = top  # odd rows: the maximum in the tail
        if rows > 3:
            x[3, : cols // 3] = float("inf")
            x[-1] = float("-inf")
        if rows > 2:
            x[1, cols - 1] = float("nan")
            x[2, [cols // 4, cols - 2]] = float("nan")
        assert torch.equal(decoder.argmax(x), x.argmax(dim=-1)), (rows, cols)
    quantised = (torch.randn(64, 2_000, generator=gen) * 4).round()  # many equal maxima
    assert torch.equal(decoder.argmax(quantised), quantised.argmax(dim=-1))
    strided = torch.randn(4, 64, generator=gen)[:, ::2]  # not contiguous: torch's own
    assert torch.equal(decoder.argmax(strided), strided.argmax(dim=-1))


def _greedy_tokens(rt, params: SamplingParams) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for i in range(3):
        rt.add_sequence(f"s{i}", random_prompt(5 + i, 40 + i), params)
    while rt.sequences:
        plan = {s: q.num_uncomputed for s, q in rt.sequences.items()}
        for o in rt.execute(StepPlan(plan)).outputs:
            tokens.setdefault(o.seq_id, []).append(o.token_id)
    return tokens


def test_a_decode_steps_call_brings_its_logits_argmax(tmp_path) -> None:
    """The kernel's call returns the decode step's argmax with its logits; sampling takes
    it for those logits unchanged, and not once penalties have changed them."""
    path, _ = make_hf_checkpoint(tmp_path)
    rt = make_runtime(path, device="cpu")
    decoder, taken = rt.runner.native_decoder, []
    take = decoder.take_argmax

    def recording(logits: torch.Tensor) -> torch.Tensor | None:
        got = take(logits)
        taken.append(None if got is None else (got.clone(), logits.argmax(dim=-1)))
        return got

    decoder.take_argmax = recording
    plain = _greedy_tokens(rt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert taken[0] is None  # the prefill step's rows: the LM head's own call
    fused = [t for t in taken if t is not None]
    assert len(fused) == 11 and all(torch.equal(got, want) for got, want in fused)

    # penalties copy the logits: the argmax is then the penalised logits' own
    penalised = SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0)
    native = _greedy_tokens(rt, penalised)
    assert native != plain  # the penalty changed some choice: this checks something
    torch_path = make_runtime(path, device="cpu", cpu_native_decode=False)
    assert native == _greedy_tokens(torch_path, penalised)
