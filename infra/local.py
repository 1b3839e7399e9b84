"""`sluice infra`: the local Kafka broker (or cluster) and PostgreSQL, started and stopped
together."""

from __future__ import annotations

import shlex

from infra import kafka_broker, postgres
from infra.common import InfraConfig, InfraError


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


def running_config(cfg: InfraConfig) -> InfraConfig:
    """`cfg` in the mode (plain, secure, or a cluster with its own ports) the local
    broker runs in, if it runs."""
    return kafka_broker.running_config(cfg)


def env(cfg: InfraConfig, mtls: bool = False) -> dict[str, str]:
    """The SLUICE_* settings of a client of the running local infrastructure."""
    cfg = running_config(cfg)
    if mtls and not cfg.secure:
        raise InfraError("mutual TLS needs the secure local broker: `sluice infra up --secure`")
    return {**kafka_broker.client_env(cfg, mtls), "SLUICE_DATABASE_URL": postgres.url(cfg)}


# Every security setting `env` may print: those a mode does not use are unset, so
# switching modes in one shell leaves nothing behind.
SECURITY_VARS = (
    "SLUICE_KAFKA__SECURITY_PROTOCOL", "SLUICE_KAFKA__SASL_MECHANISM",
    "SLUICE_KAFKA__SASL_USERNAME", "SLUICE_KAFKA__SASL_PASSWORD_FILE",
    "SLUICE_KAFKA__SSL_CAFILE", "SLUICE_KAFKA__SSL_CERTFILE", "SLUICE_KAFKA__SSL_KEYFILE",
)


def env_lines(cfg: InfraConfig, mtls: bool = False) -> list[str]:
    settings = env(cfg, mtls)
    lines = [f"unset {name}" for name in SECURITY_VARS if name not in settings]
    for name, value in settings.items():
        # URLs always quoted (a password may hold shell characters one day).
        quoted = "'" + value.replace("'", "'\\''") + "'" if "://" in value \
            else shlex.quote(value)
        lines.append(f"export {name}={quoted}")
    return lines


def endpoints(cfg: InfraConfig) -> tuple[str, str]:
    """The local broker's bootstrap servers and the local database's URL."""
    return kafka_broker.bootstrap(cfg), postgres.url(cfg)
