"""Errors of sluice's shared parts: settings, dependencies (Kafka, PostgreSQL), timeouts.

Each says what failed and what to do. `sluice.errors` is where users find them,
with the SDK's own (a request's error or timeout, an unknown model).
"""

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


class DatabaseAccessError(SluiceError):
    """PostgreSQL could not be reached, refused the login, or its TLS settings are wrong."""


class KafkaAccessError(SluiceError):
    """Kafka could not be reached, refused our login, or denied an operation."""
