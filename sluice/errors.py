"""Errors of the SDK and control plane. Each says what failed and what to do."""

from __future__ import annotations


class SluiceError(Exception):
    """Base class of every error sluice's public face raises."""


class NotFoundError(SluiceError):
    pass


class ConflictError(SluiceError):
    pass


class InvalidConfigError(SluiceError):
    pass


class LimitExceededError(SluiceError):
    pass


class OperationTimeoutError(SluiceError, TimeoutError):
    """A control-plane operation ran past SLUICE_SERVER__TIMEOUT_SECONDS."""


class DependencyTimeoutError(SluiceError, TimeoutError):
    """A call to PostgreSQL or the Kafka admin API ran past SLUICE_CLIENT__TIMEOUT_SECS."""


class RequestError(SluiceError):
    """An inference request ended with an `error` event (its `code` is the wire code)."""

    def __init__(self, request_id: str, code: str, message: str):
        self.request_id = request_id
        self.code = code
        super().__init__(f"request {request_id} failed ({code}): {message}")


class RequestTimeoutError(SluiceError, TimeoutError):
    """An inference request ended with a `timeout` event: no first token within max_ttft."""

    def __init__(self, request_id: str, waited_ms: float, max_ttft_ms: int):
        self.request_id = request_id
        self.waited_ms = waited_ms
        self.max_ttft_ms = max_ttft_ms
        super().__init__(
            f"request {request_id} timed out: no first token within max_ttft_ms={max_ttft_ms} "
            f"(waited {waited_ms:.0f} ms)"
        )
