"""Typed errors of the batcher. Each carries the wire error `code` where one applies."""

from __future__ import annotations


class BatcherError(Exception):
    """Base of every error raised by `batcher`."""

    code: str = "internal"


class ConfigError(BatcherError):
    """A `BatcherConfig` value is out of range."""


class DuplicateRequestError(BatcherError):
    """A request with this key is already in flight."""

    code = "invalid_request"


class EngineClosedError(BatcherError):
    """`submit` after `drain()` or `stop()` began."""

    code = "overloaded"
