"""The one validated settings object, built at start-up (never at import time).

Environment variables (CONTRACT.md, "Settings") with CLI flags layered on top:
`Settings.load(kafka_bootstrap=...)`. When the Kafka or database address is
not set, the local infrastructure's addresses (`sluice infra up`) are used.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.names import POOL_PATTERN


class ServerSettings(BaseModel):
    timeout_seconds: float = Field(default=60.0, gt=0)


class ClientSettings(BaseModel):
    # Each call to a dependency (PostgreSQL, the Kafka admin API, a send).
    timeout_secs: float = Field(default=60.0, gt=0)
    # How long the SDK and CLI wait for a request's terminal event.
    request_timeout_secs: float = Field(default=600.0, gt=0)


Compression = Literal["none", "gzip", "snappy", "lz4", "zstd"]


class KafkaSettings(BaseModel):
    """Options every Kafka client sluice creates shares (`SLUICE_KAFKA__*`)."""

    # Codec of the records sluice produces; any codec is read.
    compression: Compression = "none"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SLUICE_", env_nested_delimiter="__", extra="ignore", frozen=True
    )

    kafka_bootstrap: str | None = None
    database_url: str | None = None
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
    reply_topic_pattern: str | None = None
    server: ServerSettings = Field(default_factory=ServerSettings)
    client: ClientSettings = Field(default_factory=ClientSettings)
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)

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
        """Environment + explicit overrides (None means "not given")."""
        given = {k: v for k, v in overrides.items() if v is not None}
        settings = cls(**given)
        if settings.kafka_bootstrap is None or settings.database_url is None:
            from infra.common import InfraConfig
            from infra.local import endpoints

            bootstrap, url = endpoints(InfraConfig.from_env())
            settings = settings.model_copy(
                update={
                    "kafka_bootstrap": settings.kafka_bootstrap or bootstrap,
                    "database_url": settings.database_url or url,
                }
            )
        return settings

    def kafka_options(self) -> dict[str, Any]:
        """Connection options of every Kafka client sluice creates (consumers,
        producers, admin): the one place they are built."""
        return {"bootstrap_servers": self.kafka_bootstrap}

    def producer_options(self) -> dict[str, Any]:
        """`kafka_options` plus what every producer shares."""
        codec = self.kafka.compression
        return {**self.kafka_options(), "compression_type": None if codec == "none" else codec}

    def topic(self, suffix: str) -> str:
        return f"{self.topic_prefix}.{suffix}"

    def requests_topic(self, model: str) -> str:
        return self.topic(f"requests.{model}")
