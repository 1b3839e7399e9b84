"""Errors of the SDK and control plane. Each says what failed and what to do.

The errors of the shared parts (settings, Kafka, PostgreSQL, timeouts) are
defined in `common.errors` and offered here too, so users import every
sluice error from one place.
"""

from __future__ import annotations

from common.errors import (
    ConflictError,
    DatabaseAccessError,
    DependencyTimeoutError,
    InvalidConfigError,
    KafkaAccessError,
    LimitExceededError,
    NotFoundError,
    OperationTimeoutError,
    SluiceError,
)

__all__ = [
    "ConflictError",
    "DatabaseAccessError",
    "DependencyTimeoutError",
    "InvalidConfigError",
    "InvalidRequestError",
    "KafkaAccessError",
    "LimitExceededError",
    "NotFoundError",
    "OperationTimeoutError",
    "RequestError",
    "RequestTimeoutError",
    "SluiceError",
    "UnknownModelError",
]


class UnknownModelError(NotFoundError):
    """The model is not registered: it has no request topic to send to."""

    def __init__(self, model: str, topic: str, secured: bool = False):
        self.model = model
        unseen = (f"there is no request topic {topic!r}, or this client's principal may not "
                  "DESCRIBE it (Kafka ACLs)") if secured else \
            f"there is no request topic {topic!r}"
        super().__init__(
            f"model {model!r} is not registered ({unseen}); register it with "
            f"`sluice models register --model {model} --path DIR` "
            "(`sluice models list` shows the registered ones)"
        )


class InvalidRequestError(SluiceError, ValueError):
    """A request the SDK refuses to send: a field is missing, mistyped or out of range."""


class RequestError(SluiceError):
    """An inference request ended with an `error` event (its `code` is the wire code)."""

    def __init__(self, request_id: str, code: str, message: str):
        self.request_id = request_id
        self.code = code
        super().__init__(f"request {request_id} failed ({code}): {message}")


class RequestTimeoutError(SluiceError, TimeoutError):
    """An inference request timed out: it ended with a `timeout` event (no first token
    within max_ttft), or no terminal event reached the client within its own deadline
    (`client_deadline` is then True and `max_ttft_ms` None)."""

    def __init__(self, request_id: str, waited_ms: float, max_ttft_ms: int | None,
                 message: str | None = None):
        self.request_id = request_id
        self.waited_ms = waited_ms
        self.max_ttft_ms = max_ttft_ms
        self.client_deadline = max_ttft_ms is None
        self.not_started = False  # no worker started it in time (the SDK's own verdict)
        super().__init__(message or (
            f"request {request_id} timed out: no first token within max_ttft_ms={max_ttft_ms} "
            f"(waited {waited_ms:.0f} ms)"
        ))

    @classmethod
    def not_started(cls, request_id: str, model: str, max_ttft_ms: int,
                    waited_s: float) -> RequestTimeoutError:
        """No worker started the request within the model's max_ttft_ms (plus a grace):
        none serves the model now, or all that do are still loading."""
        error = cls(request_id, waited_s * 1000, max_ttft_ms, (
            f"request {request_id}: no worker started it within model {model!r}'s "
            f"max_ttft_ms={max_ttft_ms} (waited {waited_s:.1f} s). No worker serves the "
            f"model now, or every one is still starting: `sluice workers --model {model}` "
            "lists the live ones and what they are doing"))
        error.not_started = True
        return error

    @classmethod
    def no_terminal_event(cls, request_id: str, model: str,
                          timeout_s: float) -> RequestTimeoutError:
        return cls(request_id, timeout_s * 1000, None, (
            f"request {request_id}: no terminal event within {timeout_s:g} s "
            "(SLUICE_CLIENT__REQUEST_TIMEOUT_SECS, or the call's timeout). Is a worker serving "
            f"model {model!r}? `sluice workers --model {model}` lists the live ones; a worker "
            "serves a model only when its pool is in the model's compute_pools "
            f"(`sluice models show --model {model}`)"
        ))
