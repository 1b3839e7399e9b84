"""The one validated settings object, built at start-up (never at import time).

Environment variables (CONTRACT.md, "Settings") with CLI flags layered on top:
`Settings.load(kafka_bootstrap=...)`. When the Kafka or database address is
not set, the local infrastructure's addresses (`sluice infra up`) are used.

`kafka_options()` is the one place Kafka client options are built (security
included, see `common.kafka_security`); `database_dsn()` the one place the
PostgreSQL address is. Secrets are never part of a settings object's repr.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.kafka_security import KafkaSettings, client_options
from schemas.names import POOL_PATTERN

# Every Kafka client asks for the cluster's metadata at least this often (Kafka's
# default: 5 min). A leader cut off from its followers but not from its clients keeps
# serving them as if it led: without an error to make them ask, they learn of the new
# leaders only when the cut heals (`sluice bench chaos --networked`); what they sent
# the old one is let go of when they do (`common.broker_loss`). A request a client
# makes every 2 s is nothing to a broker.
METADATA_MAX_AGE_MS = 2_000
# A produce request waits this long at most (less when SLUICE_CLIENT__TIMEOUT_SECS is
# lower), then is retried (idempotent: never twice). Such a leader holds an acks=all
# write until then, and a broker answers one connection's requests in order: a metadata
# request that aiokafka sends on the same connection waits behind it, so the client
# learns of the new leader that much later (10 s: answers held ~10 s after a producer
# of a worker had heard it).
PRODUCE_TIMEOUT_S = 5.0


def produce_timeout_ms(timeout_s: float) -> int:
    """A producer's `request_timeout_ms`: PRODUCE_TIMEOUT_S, or `timeout_s` when shorter."""
    return int(min(timeout_s, PRODUCE_TIMEOUT_S) * 1000)


class ServerSettings(BaseModel):
    timeout_seconds: float = Field(default=60.0, gt=0)


class ClientSettings(BaseModel):
    # Each call to a dependency (PostgreSQL, the Kafka admin API, a send).
    timeout_secs: float = Field(default=60.0, gt=0)
    # How long the SDK and CLI wait for a request's terminal event.
    request_timeout_secs: float = Field(default=600.0, gt=0)


class DatabaseSettings(BaseModel):
    """PostgreSQL beyond its URL (`SLUICE_DATABASE__*`). The URL's own `sslmode`
    (require, verify-ca, verify-full) and `sslrootcert` are honoured."""

    # The CA that signed the server's certificate; with it and no sslmode in the URL,
    # connections use sslmode=verify-full.
    ssl_cafile: Path | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SLUICE_", env_nested_delimiter="__", extra="ignore", frozen=True,
        env_ignore_empty=True,
    )

    kafka_bootstrap: str | None = None
    database_url: str | None = Field(default=None, repr=False)  # may hold a password
    # The PostgreSQL schema holding sluice's tables (tests use one per test).
    db_schema: str = Field(default="sluice", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    # Partitions of a model's request topic when it is registered.
    request_partitions: int = Field(default=8, ge=1, le=4096)
    # Replication factor of the topics sluice creates; None: min(3, brokers).
    topic_replication_factor: int | None = Field(default=None, ge=1, le=32)
    # The worker's Prometheus endpoint (/metrics, /healthz, /readyz); 0 = any free port.
    metrics_port: int = Field(default=9400, ge=0, le=65535)
    topic_prefix: str = Field(default="sluice", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    pool: str = Field(default="default", pattern=POOL_PATTERN)
    # SLUICE_COMPILE: this host's workers compile the decode step (1) or not (0) whatever
    # the models' compute configs say; unset: the compute config decides.
    compile: bool | None = None
    reply_topic_pattern: str | None = None
    server: ServerSettings = Field(default_factory=ServerSettings)
    client: ClientSettings = Field(default_factory=ClientSettings)
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)

    @field_validator("reply_topic_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from exc
        return value

    @classmethod
    def load(cls, **overrides: object) -> Settings:
        """Environment + explicit overrides (None means "not given"). Without a Kafka
        or database address, the local infrastructure's are used — with its security
        settings when it runs `--secure` (what `sluice infra env` prints)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        settings = cls(**given)
        if settings.kafka_bootstrap is None or settings.database_url is None:
            from infra.common import InfraConfig
            from infra.local import env

            local = env(InfraConfig.from_env())
            update: dict[str, Any] = {
                "database_url": settings.database_url or local.pop("SLUICE_DATABASE_URL")}
            if settings.kafka_bootstrap is None:
                update["kafka_bootstrap"] = local.pop("SLUICE_KAFKA_BOOTSTRAP")
                security = {name.removeprefix("SLUICE_KAFKA__").lower(): value
                            for name, value in local.items()
                            if name.startswith("SLUICE_KAFKA__")}
                if security and settings.kafka.security_protocol == "PLAINTEXT":
                    update["kafka"] = KafkaSettings(
                        **{**settings.kafka.model_dump(exclude_defaults=True), **security})
            settings = settings.model_copy(update=update)
        return settings

    def kafka_options(self) -> dict[str, Any]:
        """Connection options of every Kafka client sluice creates (consumers,
        producers, admin): the one place they are built."""
        return {"bootstrap_servers": self.kafka_bootstrap,
                "metadata_max_age_ms": METADATA_MAX_AGE_MS, **client_options(self.kafka)}

    def database_dsn(self) -> str:
        """SLUICE_DATABASE_URL with SLUICE_DATABASE__SSL_CAFILE applied."""
        url = str(self.database_url)
        cafile = self.database.ssl_cafile
        if cafile is None:
            return url
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        query.setdefault("sslrootcert", str(cafile))
        query.setdefault("sslmode", "verify-full")
        return urlunsplit(parts._replace(query=urlencode(query)))

    def producer_options(self) -> dict[str, Any]:
        """`kafka_options` plus what every producer shares."""
        codec = self.kafka.compression
        return {**self.kafka_options(), "compression_type": None if codec == "none" else codec}

    def topic(self, suffix: str) -> str:
        return f"{self.topic_prefix}.{suffix}"

    def requests_topic(self, model: str) -> str:
        return self.topic(f"requests.{model}")
