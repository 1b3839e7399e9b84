"""TLS and SASL for every Kafka client sluice makes: `SLUICE_KAFKA__*`.

`KafkaSettings` validates them, naming the variable at fault;
`client_options(kafka_settings)` turns them into aiokafka's options
(`security_protocol`, an `ssl_context`, `sasl_*`). `Settings.kafka_options` is
its only caller, so every consumer, producer and admin client gets the same.
Secrets from files are read each time options are built, so a rotated secret
takes effect at the next client. `explain(exc, kafka_settings)` turns an
authorization failure into one line naming what to grant; `kafka_connect` does
the same for a connection or login that fails.
"""

from __future__ import annotations

import asyncio
import importlib
import ssl
from pathlib import Path
from typing import Any, Literal

from aiokafka.abc import AbstractTokenProvider
from pydantic import BaseModel, SecretStr, model_validator

from common.errors import InvalidConfigError

ENV = "SLUICE_KAFKA__"
TLS_PROTOCOLS = ("SSL", "SASL_SSL")
SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
# Settings given directly or through a file: one or the other.
EXCLUSIVE = (("sasl_username", "sasl_username_file"), ("sasl_password", "sasl_password_file"),
             ("ssl_key_password", "ssl_key_password_file"),
             ("sasl_oauth_token_provider", "sasl_oauth_token_file"))


Compression = Literal["none", "gzip", "snappy", "lz4", "zstd"]


SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]


class KafkaSettings(BaseModel):
    """Options every Kafka client sluice creates shares (`SLUICE_KAFKA__*`).

    Secrets may come from files (`..._FILE`, e.g. a mounted Kubernetes Secret),
    read whenever a client is made."""

    # Codec of the records sluice produces; any codec is read.
    compression: Compression = "none"
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_username_file: Path | None = None
    sasl_password: SecretStr | None = None
    sasl_password_file: Path | None = None
    # OAUTHBEARER: "module:attribute", an aiokafka AbstractTokenProvider (class or
    # factory) of yours; or a file holding the token, read again for every login
    # (a projected service-account token, say).
    sasl_oauth_token_provider: str | None = None
    sasl_oauth_token_file: Path | None = None
    # TLS: the CA that signed the brokers' certificates (default: the system's), and
    # a client certificate and key for mutual TLS.
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_key_password: SecretStr | None = None
    ssl_key_password_file: Path | None = None
    ssl_check_hostname: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSettings:
        problem = settings_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self


def settings_problem(k: KafkaSettings) -> str | None:
    """What is inconsistent in `SLUICE_KAFKA__*`, naming the variables; None if nothing."""
    protocol = k.security_protocol
    if protocol in SASL_PROTOCOLS and k.sasl_mechanism is None:
        return (f"{ENV}SECURITY_PROTOCOL={protocol} needs {ENV}SASL_MECHANISM (PLAIN, "
                "SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER)")
    if protocol not in SASL_PROTOCOLS and k.sasl_mechanism is not None:
        return (f"{ENV}SASL_MECHANISM is set but {ENV}SECURITY_PROTOCOL is {protocol}: "
                "use SASL_SSL (or SASL_PLAINTEXT)")
    tls_set = [name for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile")
               if getattr(k, name) is not None]
    if protocol not in TLS_PROTOCOLS and tls_set:
        return (f"{ENV}{tls_set[0].upper()} is set but {ENV}SECURITY_PROTOCOL is {protocol}: "
                "use SSL or SASL_SSL")
    if k.ssl_keyfile is not None and k.ssl_certfile is None:
        return f"{ENV}SSL_KEYFILE needs {ENV}SSL_CERTFILE (the client certificate)"
    for direct, from_file in EXCLUSIVE:
        if getattr(k, direct) is not None and getattr(k, from_file) is not None:
            return f"set {ENV}{direct.upper()} or {ENV}{from_file.upper()}, not both"
    if k.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        for name in ("sasl_username", "sasl_password"):
            if getattr(k, name) is None and getattr(k, f"{name}_file") is None:
                return (f"{ENV}SASL_MECHANISM={k.sasl_mechanism} needs {ENV}{name.upper()} "
                        f"(or {ENV}{name.upper()}_FILE)")
    if k.sasl_mechanism == "OAUTHBEARER" and k.sasl_oauth_token_provider is None \
            and k.sasl_oauth_token_file is None:
        return (f"{ENV}SASL_MECHANISM=OAUTHBEARER needs {ENV}SASL_OAUTH_TOKEN_PROVIDER "
                f"(module:attribute) or {ENV}SASL_OAUTH_TOKEN_FILE")
    return None


def _read(path: Path, setting: str) -> str:
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise InvalidConfigError(f"{ENV}{setting}: cannot read {path}: {exc.strerror}") from None
    if not value:
        raise InvalidConfigError(f"{ENV}{setting}: {path} is empty")
    return value


def _secret(k: KafkaSettings, name: str) -> str | None:
    direct = getattr(k, name)
    if direct is not None:
        return direct.get_secret_value() if hasattr(direct, "get_secret_value") else direct
    path = getattr(k, f"{name}_file")
    return None if path is None else _read(path, f"{name.upper()}_FILE")


def ssl_context(k: KafkaSettings) -> ssl.SSLContext:
    """Server verification against SSL_CAFILE (else the system's CAs), hostname checked
    unless SSL_CHECK_HOSTNAME=false; a client certificate when SSL_CERTFILE is set."""
    try:
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(k.ssl_cafile) if k.ssl_cafile else None)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidConfigError(
            f"{ENV}SSL_CAFILE: cannot load {k.ssl_cafile} as PEM certificates: {exc}") from None
    context.check_hostname = k.ssl_check_hostname
    if k.ssl_certfile is not None:
        try:
            context.load_cert_chain(str(k.ssl_certfile),
                                    str(k.ssl_keyfile) if k.ssl_keyfile else None,
                                    _secret(k, "ssl_key_password"))
        except (OSError, ssl.SSLError) as exc:
            raise InvalidConfigError(
                f"{ENV}SSL_CERTFILE/{ENV}SSL_KEYFILE: cannot load the client certificate "
                f"{k.ssl_certfile} and its key: {exc}") from None
    return context


class FileTokenProvider(AbstractTokenProvider):
    """An OAUTHBEARER token read from a file at every login, so whoever renews the file
    (a projected service-account token, a sidecar) renews the token."""

    def __init__(self, path: Path):
        self.path = path

    async def token(self) -> str:
        return await asyncio.to_thread(_read, self.path, "SASL_OAUTH_TOKEN_FILE")


def token_provider(k: KafkaSettings) -> AbstractTokenProvider:
    if k.sasl_oauth_token_file is not None:
        return FileTokenProvider(k.sasl_oauth_token_file)
    spec = str(k.sasl_oauth_token_provider)
    module_name, _, attribute = spec.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
        provider = target() if callable(target) else target
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise InvalidConfigError(
            f"{ENV}SASL_OAUTH_TOKEN_PROVIDER={spec!r}: cannot make a token provider "
            f"({type(exc).__name__}: {exc}); name a module:attribute whose value (or call "
            "result) is an aiokafka AbstractTokenProvider") from None
    if not isinstance(provider, AbstractTokenProvider):
        raise InvalidConfigError(
            f"{ENV}SASL_OAUTH_TOKEN_PROVIDER={spec!r} gave a {type(provider).__name__}, not an "
            "aiokafka.abc.AbstractTokenProvider")
    return provider


def client_options(k: KafkaSettings) -> dict[str, Any]:
    """aiokafka keyword arguments for the security part of `SLUICE_KAFKA__*`."""
    options: dict[str, Any] = {"security_protocol": k.security_protocol}
    if k.security_protocol in TLS_PROTOCOLS:
        options["ssl_context"] = ssl_context(k)
    if k.security_protocol in SASL_PROTOCOLS:
        options["sasl_mechanism"] = k.sasl_mechanism
        if k.sasl_mechanism == "OAUTHBEARER":
            options["sasl_oauth_token_provider"] = token_provider(k)
        else:
            options["sasl_plain_username"] = _secret(k, "sasl_username")
            options["sasl_plain_password"] = _secret(k, "sasl_password")
    return options


def principal(k: KafkaSettings) -> str:
    """Who Kafka sees, as far as the settings tell."""
    if k.security_protocol in SASL_PROTOCOLS and k.sasl_mechanism != "OAUTHBEARER":
        try:
            return f"User:{_secret(k, 'sasl_username')}"
        except InvalidConfigError:
            return "the SASL user"
    if k.sasl_mechanism == "OAUTHBEARER":
        return "the OAUTHBEARER token's principal"
    if k.ssl_certfile is not None:
        return f"the principal of the client certificate {k.ssl_certfile}"
    return "User:ANONYMOUS"


ACL_HELP = "the ACLs sluice needs are listed in infra/helm/sluice/README.md"


def explain(exc: BaseException, k: KafkaSettings, action: str = "") -> str | None:
    """One line for an authorization failure, naming what to grant; None for others."""
    from aiokafka.errors import (
        ClusterAuthorizationFailedError,
        GroupAuthorizationFailedError,
        TopicAuthorizationFailedError,
        TransactionalIdAuthorizationFailed,
    )

    who = principal(k)
    doing = f" ({action})" if action else ""
    if isinstance(exc, TopicAuthorizationFailedError):
        topics = ", ".join(str(a) for a in exc.args) or "a topic"
        return (f"Kafka denied {who} access to topic {topics}{doing}: grant it READ and DESCRIBE "
                f"to read, WRITE and DESCRIBE to write — {ACL_HELP}")
    if isinstance(exc, GroupAuthorizationFailedError):
        return (f"Kafka denied {who} its consumer group{doing}: grant READ on the group — "
                f"{ACL_HELP}")
    if isinstance(exc, TransactionalIdAuthorizationFailed):
        return (f"Kafka denied {who} its transactional id{doing}: grant WRITE and DESCRIBE on "
                f"it — {ACL_HELP}")
    if isinstance(exc, ClusterAuthorizationFailedError):
        return (f"Kafka denied {who} a cluster operation{doing} (an idempotent producer needs "
                f"IDEMPOTENT_WRITE, implied by WRITE on any topic) — {ACL_HELP}")
    return None
