"""Typed errors of the runtime.

Each error carries the wire error `code` (CONTRACT.md) that the batcher puts
in the request's `error` event, so no caller has to map exception classes to
codes. Errors about one request (`SequenceError`) are raised when the request
is added, before it can share a step with other requests.
"""

from __future__ import annotations


class RuntimeErrorBase(Exception):
    """Base of every error raised by `gpu_runtime`."""

    code: str = "internal"  # a subclass sets it only where it differs from its parent's


class SequenceError(RuntimeErrorBase):
    """Something is wrong with one request; other requests are unaffected."""

    code = "invalid_request"


class InvalidSequenceError(SequenceError):
    """Bad sampling parameters, empty prompt, token ids outside the vocabulary."""


class ContextTooLongError(SequenceError):
    """The prompt does not fit the model's context or the KV cache."""

    code = "context_too_long"


class ModelLoadError(RuntimeErrorBase):
    """The model directory is missing, incomplete or of an unsupported kind."""


class InsufficientMemoryError(RuntimeErrorBase):
    """Weights + KV cache + activation reserve do not fit in device memory."""


class SchedulingError(RuntimeErrorBase):
    """The step plan is inconsistent with the runtime's state (a batcher bug)."""


class OutOfBlocksError(SchedulingError):
    """The plan needs more KV blocks than are free; nothing was changed."""

    code = "overloaded"


class AdapterError(SequenceError):
    """A LoRA adapter is missing, malformed, or does not fit the base model / the slots."""


class RankFailure(RuntimeErrorBase):
    """A tensor-parallel rank died, hung past the collective timeout, or failed to load.

    The replica cannot continue (its ranks no longer agree on what was computed):
    close the `Runtime` and build a new one.
    """
