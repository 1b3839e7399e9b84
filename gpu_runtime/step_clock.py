"""Where a step's time goes: `Runtime.execute` split into its parts, summed over steps.

Always on (a handful of `perf_counter` calls a step). On a CPU each part is its own
compute; on CUDA kernels run asynchronously, so `model_s` is the time to launch them
and the wait for them lands in `sample_s` (its first read of the logits), unless the
caller synchronises.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StepClock:
    steps: int = 0
    plan_s: float = 0.0  # checking the plan, reserving blocks, gathering each row's tokens
    inputs_s: float = 0.0  # the step's input tensors: ids, positions, slots, block tables
    model_s: float = 0.0  # the model's forward pass and the LM head of the sampled rows
    sample_s: float = 0.0  # penalties, grammar masks, sampling, stop checks, finishing

    def reset(self) -> None:
        self.steps = 0
        self.plan_s = self.inputs_s = self.model_s = self.sample_s = 0.0

    @property
    def total_s(self) -> float:
        return self.plan_s + self.inputs_s + self.model_s + self.sample_s

    def snapshot(self) -> dict[str, float]:
        return {**asdict(self), "total_s": self.total_s}
