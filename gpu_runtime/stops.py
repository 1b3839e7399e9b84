"""When a sequence is done: stop token ids, stop strings, max_tokens, context limit."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from gpu_runtime.sequence import Sequence

# Tokens decoded to look for a stop string that ends at the newest token: enough
# for any stop string of up to this many characters plus multi-byte characters.
_STOP_WINDOW_EXTRA_TOKENS = 8


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def check_stop(
    seq: Sequence, token_id: int, tokenizer: Tokenizer | None, max_total_tokens: int
) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) after `token_id` was appended to `seq`."""
    if token_id in seq.stop_token_ids:
        return "stop", token_id
    if seq.params.stop and tokenizer is not None:
        longest = max(len(s) for s in seq.params.stop)
        window = seq.token_ids[seq.num_prompt_tokens :][-(longest + _STOP_WINDOW_EXTRA_TOKENS) :]
        # Checked after every token, so any match in the tail is a new one.
        tail = tokenizer.decode(window)
        for stop in seq.params.stop:
            if stop in tail:
                return "stop", stop
    if seq.num_generated >= seq.params.max_tokens or seq.num_tokens >= max_total_tokens:
        return "length", None
    return None, None
