"""`sluice infra`: the local Kafka broker and PostgreSQL, started and stopped together."""

from __future__ import annotations

from infra import kafka_broker, postgres
from infra.common import InfraConfig


def up(cfg: InfraConfig) -> dict[str, dict[str, object]]:
    """Start whatever is not running yet (a no-op for what already is)."""
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    return {"kafka": kafka_broker.up(cfg), "postgres": postgres.up(cfg)}


def down(cfg: InfraConfig) -> dict[str, bool]:
    """Stop what this state directory started; returns which ones were stopped."""
    return {"kafka": kafka_broker.down(cfg), "postgres": postgres.down(cfg)}


def purge(cfg: InfraConfig) -> dict[str, bool]:
    """Stop both and delete their data (topics, databases); returns which had any."""
    return {"kafka": kafka_broker.purge(cfg), "postgres": postgres.purge(cfg)}


def status(cfg: InfraConfig) -> dict[str, dict[str, object]]:
    return {"kafka": kafka_broker.status(cfg), "postgres": postgres.status(cfg)}


def env_lines(cfg: InfraConfig) -> list[str]:
    return [
        f"export SLUICE_KAFKA_BOOTSTRAP={kafka_broker.bootstrap(cfg)}",
        f"export SLUICE_DATABASE_URL='{postgres.url(cfg)}'",
    ]


def endpoints(cfg: InfraConfig) -> tuple[str, str]:
    """The local broker's bootstrap servers and the local database's URL."""
    return kafka_broker.bootstrap(cfg), postgres.url(cfg)
