"""The `cpu` scenario's workload, the same for every engine: the prompt, the job sizes,
and sluice's variants (each names a dtype and what it turns off)."""

from __future__ import annotations

CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
               "Hugging Face<|im_end|>\n<|im_start|>user\nWrite two sentences about rivers."
               "<|im_end|>\n<|im_start|>assistant\n")
GREEDY_TOKENS = 64
PREFILL_LEN = 512
CONCURRENT = (8, 32)
SLUICE_DTYPES = ("float32", "bfloat16")
# sluice's CPU projections on `F.linear` (`cpu_prepack` off): what the packed weights gain.
UNPACKED = "float32 F.linear"
# sluice's all-decode steps through torch (`cpu_native_decode` off, the attention still
# native): what the one-call decode step (gpu_runtime/cpu_decode.py) gains.
TORCH_DECODE = "bfloat16 torch decode"
# ... and with the decode attention on the torch path too (`cpu_native_attention` off, which
# takes the native decode step with it): what the attention kernel gained in torch's steps.
TORCH_ATTENTION = "bfloat16 torch attention"


def distinct_prompt(prompt: list[int], i: int, vocab: int) -> list[int]:
    """The prompt with its first token made distinct per sequence (no shared prefix)."""
    return [(prompt[0] + 1 + i) % vocab, *prompt[1:]]
