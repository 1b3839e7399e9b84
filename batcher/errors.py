"""Typed errors of the batcher. Each carries the wire error `code` where one applies."""

from __future__ import annotations


class BatcherError(Exception):
    """Base of every error raised by `batcher`."""

    code: str = "internal"


class ConfigError(BatcherError):
    """A `BatcherConfig` value is out of range."""


class InvalidRequestError(BatcherError):
    """A submitted request is malformed (empty id, negative max_ttft, ...)."""

    code = "invalid_request"


class DuplicateRequestError(InvalidRequestError):
    """A request with this id and attempt is already in flight."""


class EngineClosedError(BatcherError):
    """`submit` after `drain()` or `stop()` began."""

    code = "overloaded"
