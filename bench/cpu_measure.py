"""One measurement of one engine in the `cpu` scenario, run in a process of its own:
sluice's runner, the transformers reference (greedy tokens only), and the dispatch of
each job to the engine's runner."""

from __future__ import annotations

import time
from typing import Any

from bench.cpu_workload import (
    GREEDY_TOKENS,
    PREFILL_LEN,
    TORCH_ATTENTION,
    TORCH_DECODE,
    UNPACKED,
    distinct_prompt,
)
from bench.llama_cpp_engine import LlamaRunner


def measure(engine: str, variant: str, path: str, threads: int, jobs: tuple[str, ...],
            prompt_ids: list[int]) -> dict[str, Any]:
    """Run `jobs` on one engine; returns {job: result}. Runs in a fresh process."""
    if engine == "transformers":  # the reference: greedy tokens only
        return {"greedy": _transformers_greedy(path, variant, threads, prompt_ids)}
    runner = (_SluiceRunner(path, variant, threads) if engine == "sluice"
              else LlamaRunner(path, threads, repack=not variant.endswith("no-repack")))
    out: dict[str, Any] = {}
    for job in jobs:
        if job == "greedy":
            out[job] = runner.greedy(prompt_ids, GREEDY_TOKENS)
        elif job == "decode_1":
            out[job] = runner.decode_tps(1, prompt_ids[:24], 48)
        elif job.startswith("decode_"):
            out[job] = runner.decode_tps(int(job.split("_")[1]), prompt_ids[:24], 24)
        elif job == "prefill":
            out[job] = runner.prefill_tps(PREFILL_LEN)
        else:
            raise ValueError(job)
    return out


def _transformers_greedy(path: str, dtype: str, threads: int, prompt: list[int]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()



class _SluiceRunner:
    def __init__(self, path: str, dtype: str, threads: int):
        import torch

        from gpu_runtime import Runtime, RuntimeConfig

        torch.set_num_threads(threads)
        # a GGUF file's variant names its quantization: the file decides (float32 activations)
        self.rt = Runtime(path, RuntimeConfig(
            device="cpu", dtype=None if path.endswith(".gguf") else dtype.split()[0],
            kv_cache_len=16384,
            max_num_batched_tokens=1024, cpu_prepack=dtype != UNPACKED,
            cpu_native_attention=dtype != TORCH_ATTENTION,
            cpu_native_decode=dtype not in (TORCH_DECODE, TORCH_ATTENTION)))
        self.vocab = self.rt.model_config.vocab_size
        self.n = 0

    def _add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from gpu_runtime.sequence import SamplingParams

        ids = []
        for p in prompts:
            self.n += 1
            ids.append(f"s{self.n}")
            self.rt.add_sequence(ids[-1], p, SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True))
        return ids

    def _step(self, ids: list[str]) -> list[int]:
        from gpu_runtime.sequence import StepPlan

        plan = {s: self.rt.sequences[s].num_uncomputed for s in ids if s in self.rt.sequences}
        return [o.token_id for o in self.rt.execute(StepPlan(plan)).outputs]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = self._add([prompt], n)
        return [t for _ in range(n) for t in self._step(ids)]

    def decode_tps(self, batch: int, prompt: list[int], steps: int) -> float:
        ids = self._add([distinct_prompt(prompt, i + 100 * self.n, self.vocab)
                         for i in range(batch)], steps + 2)
        self._step(ids)  # the prefill and the first token
        self._step(ids)
        started = time.perf_counter()
        for _ in range(steps):
            self._step(ids)
        return batch * steps / (time.perf_counter() - started)

    def prefill_tps(self, length: int) -> float:
        best = 0.0
        for r in range(3):
            prompt = [(7 * i + 13 * r + 1) % self.vocab for i in range(length)]
            ids = self._add([prompt], 1)
            started = time.perf_counter()
            self._step(ids)
            best = max(best, length / (time.perf_counter() - started))
        return best
