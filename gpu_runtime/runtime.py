"""`Runtime`: the object the batcher drives (see the package docstring for the API).

It owns the sequences, the block manager and the model runner. Each call is
check-then-act: a bad request is rejected by `add_sequence` before it can
share a step; a bad plan raises before any state changes.

With `tp > 1` this process is rank 0 of the replica: it spawns the helper
ranks (`ranks.py`), holds its own shard, and its runner broadcasts each step
to the others. Everything else — sequences, blocks, adapter slots, sampling —
lives here only, unchanged.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from gpu_runtime import penalties
from gpu_runtime.block_manager import BlockManager
from gpu_runtime.config import ModelConfig, RuntimeConfig, context_limit
from gpu_runtime.cpu_decode import NativeDecoder, decodes_natively
from gpu_runtime.cpu_linear import prepacks
from gpu_runtime.errors import (
    AdapterError,
    ContextTooLongError,
    InvalidSequenceError,
    ModelLoadError,
    SchedulingError,
)
from gpu_runtime.gguf_folder import servable_dir, weights_file
from gpu_runtime.gguf_weights import gguf_weight_bytes
from gpu_runtime.grammar import Grammars, mask_rows
from gpu_runtime.loader import default_dtype, resolve_dtype
from gpu_runtime.lora_format import AdapterInfo
from gpu_runtime.parallel import check_tp
from gpu_runtime.planner import MemoryPlan, MemoryRequest, available_device_bytes, plan_memory
from gpu_runtime.ranks import HelperRanks, TPRunner, build_shard
from gpu_runtime.runner import ScheduledSeq
from gpu_runtime.sampling import make_batch, sample, torch_argmax
from gpu_runtime.sequence import (
    SamplingParams,
    SeqOutput,
    Sequence,
    StepOutput,
    StepPlan,
)
from gpu_runtime.sequences import SequenceTable
from gpu_runtime.step_clock import StepClock
from gpu_runtime.stops import check_stop, load_tokenizer


class Runtime:
    def __init__(self, model_path: str | Path, config: RuntimeConfig | None = None) -> None:
        self.config = config = config or RuntimeConfig()
        model_path = servable_dir(model_path)  # a .gguf file: its folder (gguf_folder.py)
        self.model_config = mc = ModelConfig.from_dir(model_path)
        self.device = torch.device(config.device)
        check_tp(mc, config.tp)
        gguf_file = weights_file(model_path)
        if gguf_file is not None and config.compile:
            # the quantized products are native calls, which torch.compile cannot trace
            self.config = config = dataclasses.replace(config, compile=False)
        # a GGUF file's quantized products compute in float32 (their activations' dtype)
        dtype = resolve_dtype(config.dtype or ("float32" if gguf_file is not None
                                               else default_dtype(mc, self.device)))
        request = MemoryRequest(
            dtype=dtype,
            kv_cache_len=config.kv_cache_len,
            block_size=config.block_size,
            tp=config.tp,
            quantization=config.quantization,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_adapters=config.max_adapters,
            max_lora_rank=config.max_lora_rank,
            lm_head_copy=(config.tp == 1 and prepacks(config, self.device, dtype)
                          and gguf_file is None),
            decode_copy=decodes_natively(config, self.device, dtype) and gguf_file is None,
            weight_bytes=None if gguf_file is None else gguf_weight_bytes(gguf_file),
        )
        available = config.memory_budget_bytes or available_device_bytes(self.device)
        self.memory_plan: MemoryPlan = plan_memory(mc, request, available)
        if config.max_adapters < 0 or config.max_lora_rank < 1:
            raise ModelLoadError("need max_adapters >= 0 and max_lora_rank >= 1")
        self.max_model_len = context_limit(mc, config.max_model_len)
        num_blocks = self.memory_plan.num_blocks
        self.ranks: HelperRanks | None = None
        if config.tp > 1:
            self.ranks = HelperRanks(model_path, config, dtype, num_blocks, self.max_model_len)
        try:
            runner, self.adapters = build_shard(
                model_path, mc, config, dtype, self.device, num_blocks, self.max_model_len,
                self.ranks.group if self.ranks is not None else None,
            )  # fmt: skip
            if self.ranks is not None:
                self.ranks.wait_ready()
        except BaseException:
            self.close()
            raise
        self.runner = runner if self.ranks is None else TPRunner(runner, self.ranks, self.adapters)
        self.table = SequenceTable(BlockManager(num_blocks, config.block_size))
        self.model_dir = Path(model_path)  # the folder served (a .gguf file: its folder)
        # the weights as held: a GGUF file's quantized formats, else the dtype
        model = getattr(self.runner, "model", None)
        self.weights_format: str = getattr(model, "weights_format",
                                           str(dtype).removeprefix("torch."))
        self.tokenizer = load_tokenizer(model_path)
        self._grammars: Grammars | None = None
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.clock = StepClock()  # where the steps' time went (`sluice bench overhead`)
        # the CPU kernels' argmax, and the one a decode step's call returns with its logits
        self._decoder: NativeDecoder | None = getattr(self.runner, "native_decoder", None)
        self._argmax = self._decoder.argmax if self._decoder is not None else torch_argmax

    def close(self) -> None:
        """Stop the helper ranks (tp > 1); a no-op at tp=1. The runtime is unusable after."""
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def helper_pids(self) -> list[int]:
        """Process ids of ranks 1..tp-1 (empty at tp=1)."""
        return self.ranks.pids if self.ranks is not None else []

    def warm_up(self) -> float | None:
        """Compile the decode step now (`RuntimeConfig.compile`); returns the seconds it
        took, None when the runtime steps eagerly (no compile, or it failed:
        `compile_failure`). Touches no sequence's cache. At tp=1 it may run in another
        thread while `execute` serves eagerly: steps take the graphs once it returns."""
        compiled = self.runner.compiled
        if compiled is None:
            return None
        started = time.perf_counter()
        if not self.runner.warm_up():
            return None
        compiled.warmup_s = time.perf_counter() - started
        return compiled.warmup_s

    @property
    def compiled_ready(self) -> bool:
        """Whether live decode steps take the compiled graphs now."""
        compiled = self.runner.compiled
        return compiled is not None and compiled.ready and compiled.failure is None

    @property
    def compile_failure(self) -> str | None:
        """Why the compiled step was given up for eager steps; None if it was not."""
        compiled = self.runner.compiled
        return compiled.failure if compiled is not None else None

    # ---- queries --------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def sequences(self) -> dict[str, Sequence]:
        return self.table.sequences

    @property
    def block_manager(self) -> BlockManager:
        return self.table.block_manager

    @property
    def kv_capacity_tokens(self) -> int:
        return self.table.capacity_tokens

    @property
    def num_adapter_swaps(self) -> int:
        return self.adapters.num_adapter_swaps

    def num_cached_tokens(self, token_ids: Seq[int], adapter_key: str | None = None) -> int:
        """Prompt tokens a request would find in the KV cache now. No side effects."""
        return self.block_manager.num_cached_tokens(token_ids, adapter_key)

    def num_blocks_needed(self, num_scheduled_tokens: dict[str, int]) -> int:
        """New KV blocks a plan with these counts would take."""
        return self.table.num_blocks_needed(num_scheduled_tokens)

    def can_schedule(self, num_scheduled_tokens: dict[str, int]) -> bool:
        return self.table.can_schedule(num_scheduled_tokens)

    def get_sequence(self, seq_id: str) -> Sequence:
        return self.sequences[seq_id]

    def check_invariants(self) -> None:
        self.table.check_invariants()

    # ---- adapters ---------------------------------------------------------------------

    def register_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        """Validate a PEFT LoRA directory and keep its weights in host memory."""
        info = self.adapters.register(name, path)
        if self.ranks is not None:  # rank 0 validated it: the others load their shards
            self.ranks.run(("register", name, str(path)))
        return info

    def unregister_adapter(self, name: str) -> bool:
        """Forget an adapter; refused (`AdapterError`) while a sequence uses it."""
        users = [s.seq_id for s in self.sequences.values() if s.adapter_key == name]
        if users:
            raise AdapterError(f"adapter {name!r} is in use by {len(users)} sequences")
        removed = self.adapters.unregister(name)
        if removed and self.ranks is not None:
            self.ranks.run(("unregister", name))
        return removed

    # ---- sequence lifecycle -----------------------------------------------------------

    def add_sequence(
        self,
        seq_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        adapter_key: str | None = None,
    ) -> int:
        """Validate and admit a request; returns its prompt tokens found in the cache.

        Raises `InvalidSequenceError` or `ContextTooLongError`; then nothing changed.
        """
        params = params or SamplingParams()
        prompt = self._validate(seq_id, prompt_token_ids, params, adapter_key)
        room = self._context_len - len(prompt)
        if params.max_tokens > room:  # only a default max_tokens gets here (`_validate`)
            params = dataclasses.replace(params, max_tokens=room)
        stops = set() if params.ignore_eos else set(self.model_config.eos_token_ids)
        stops.update(params.stop_token_ids or ())
        seq = Sequence(seq_id, prompt, len(prompt), params, adapter_key, frozenset(stops))
        if params.seed is not None:
            seq.generator = torch.Generator(self.device).manual_seed(params.seed)
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar)
        return self.table.add(seq)

    @property
    def grammars(self) -> Grammars:
        """Output grammars (response_format) against this model's tokenizer."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidSequenceError("response_format needs a model with tokenizer.json")
            self._grammars = Grammars(self.tokenizer.to_str(), self.model_config.vocab_size,
                                      self.model_config.eos_token_ids)
        return self._grammars

    def _validate(
        self, seq_id: str, token_ids: Seq[int], params: SamplingParams, adapter_key: str | None
    ) -> list[int]:
        if seq_id in self.sequences:
            raise InvalidSequenceError(f"sequence {seq_id!r} is already running")
        prompt = [int(t) for t in token_ids]
        if not prompt:
            raise InvalidSequenceError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidSequenceError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        limit = self._context_len
        why = f"max_model_len={self.max_model_len}, kv_cache_len={self.kv_capacity_tokens}"
        if len(prompt) >= limit:
            raise ContextTooLongError(
                f"prompt has {len(prompt)} tokens; the limit is {limit - 1} ({why})")
        if params.max_tokens < 1:
            raise InvalidSequenceError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if params.max_tokens_asked and len(prompt) + params.max_tokens > limit:
            raise ContextTooLongError(
                f"the prompt's {len(prompt)} tokens and max_tokens={params.max_tokens} make "
                f"{len(prompt) + params.max_tokens} tokens, beyond this model's context of "
                f"{limit} tokens ({why}): lower max_tokens to {limit - len(prompt)} or less, "
                "or shorten the prompt")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
            raise InvalidSequenceError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        if adapter_key is not None and adapter_key not in self.adapters.adapters:
            raise InvalidSequenceError(f"adapter {adapter_key!r} is not registered")
        if params.stop and self.tokenizer is None:
            raise InvalidSequenceError("stop strings need a model with tokenizer.json")
        if any(not 0 <= t < vocab for t in params.stop_token_ids or ()):
            raise InvalidSequenceError("stop_token_ids outside the vocabulary")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise InvalidSequenceError(f"logit_bias names a token outside the vocabulary "
                                       f"[0, {vocab})")
        if params.repetition_penalty <= 0:
            raise InvalidSequenceError("repetition_penalty must be above 0")
        return prompt

    @property
    def _context_len(self) -> int:
        """Tokens one sequence may hold, prompt and output: the model's context, and at
        most the whole KV cache."""
        return min(self.max_model_len, self.kv_capacity_tokens)

    def remove_sequence(self, seq_id: str) -> bool:
        """Drop a sequence (cancelled, timed out); its full blocks stay cached."""
        return self.table.remove(seq_id)

    def preempt(self, seq_id: str) -> None:
        """Free a sequence's blocks but keep its state; `resume` it later."""
        self.table.preempt(seq_id)

    def resume(self, seq_id: str) -> int:
        """Re-admit a preempted sequence; returns its tokens found in the cache."""
        return self.table.resume(seq_id)

    # ---- the step ---------------------------------------------------------------------

    def _check_plan(self, plan: StepPlan) -> list[tuple[Sequence, int]]:
        work = self.table.check_plan(plan)
        num_adapters = len({s.adapter_key for s, _ in work} - {None})
        if num_adapters > self.adapters.num_slots:
            raise SchedulingError(
                f"plan uses {num_adapters} adapters; there are {self.adapters.num_slots} slots"
            )
        return work

    def execute(self, plan: StepPlan) -> StepOutput:
        started = time.perf_counter()
        work = self._check_plan(plan)
        if not work:
            return StepOutput([], {})
        slots = self.adapters.ensure_resident({s.adapter_key for s, _ in work} - {None})
        slots[None] = -1
        # Decodes first, sorted by adapter slot: same-adapter rows form one LoRA segment.
        work.sort(key=lambda w: (w[1] != 1, slots[w[0].adapter_key] if w[1] == 1 else 0))
        scheduled = []
        for seq, n in work:
            self.table.reserve(seq, n)
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start : start + n]
            scheduled.append(ScheduledSeq(tokens, start, seq.block_table, slots[seq.adapter_key]))
        to_sample = [i for i, (seq, n) in enumerate(work) if n == seq.num_uncomputed]
        planned = time.perf_counter()
        logits = self.runner.forward(scheduled, to_sample)  # [len(to_sample), vocab]
        computed_at = time.perf_counter()
        for seq, n in work:
            self.table.computed(seq, n)
        computed = {seq.seq_id: seq.num_computed_tokens for seq, _ in work}
        sampled_seqs = [work[i][0] for i in to_sample]
        outputs = self._sample_and_finish(sampled_seqs, logits)
        kept = None
        if plan.return_logits:
            kept = {s.seq_id: logits[i] for i, s in enumerate(sampled_seqs)}
        clock, inputs_s = self.clock, getattr(self.runner, "last_inputs_s", 0.0)
        clock.steps += 1
        clock.plan_s += planned - started
        clock.inputs_s += inputs_s
        clock.model_s += computed_at - planned - inputs_s
        clock.sample_s += time.perf_counter() - computed_at
        return StepOutput(outputs, computed, kept)

    def _sample_and_finish(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SeqOutput]:
        if not seqs:
            return []
        params = [s.params for s in seqs]
        batch = make_batch(
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [s.generator for s in seqs],
            logits.device,
        )
        # Constrained rows sample from their grammar's tokens only; log probabilities stay
        # those of the model's own distribution.
        matchers = [s.matcher for s in seqs]
        constrained = any(m is not None for m in matchers)
        adjusted = penalties.process(logits, seqs)
        # A decode step's logits came with their argmax. Penalties and grammar masks work
        # on copies, so only the logits as the step wrote them take it.
        fused = self._decoder.take_argmax(logits) if self._decoder is not None else None
        argmax = self._argmax if fused is None else (
            lambda x: fused if x is logits else self._argmax(x))
        sampled = sample(mask_rows(adjusted, matchers) if constrained else adjusted, batch,
                         self.generator, argmax)
        token_ids = sampled.tolist()
        logprobs = _logprobs(logits, sampled, [p.logprobs for p in params])
        limit = self._context_len
        outputs = []
        for row, (seq, token_id) in enumerate(zip(seqs, token_ids, strict=True)):
            seq.token_ids.append(token_id)
            reason, stop_reason = check_stop(seq, token_id, self.tokenizer, limit)
            # A grammar complete (only the end may follow) or, never with the mask
            # applied, refusing the token: nothing more can be generated within it.
            if seq.matcher is not None and reason is None and (
                    not seq.matcher.consume_token(token_id) or seq.matcher.is_stopped()):
                reason = "stop"
            outputs.append(
                SeqOutput(
                    seq.seq_id,
                    token_id,
                    reason is not None,
                    reason,
                    stop_reason,
                    seq.num_cached_prompt_tokens,
                    seq.num_generated,
                    *logprobs.get(row, (None, ())),
                )
            )
            if reason is not None:
                self.remove_sequence(seq.seq_id)
        return outputs


def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, wanted: list[int | None]
              ) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """Per row that asked: (the sampled token's log probability, the k most likely
    tokens' (id, log probability)), from the log-softmax of the raw logits."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    if not rows:
        return {}
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = logp.gather(1, sampled.index_select(0, index)[:, None]).squeeze(1).tolist()
    k_max = max(wanted[i] or 0 for i in rows)
    top_v, top_i = logp.topk(k_max, dim=-1) if k_max else (logp[:, :0], logp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out = {}
    for j, row in enumerate(rows):
        k = wanted[row] or 0
        out[row] = (chosen[j], tuple(zip(top_i[j][:k], top_v[j][:k], strict=True)))
    return out
