"""SLUICE_KAFKA__* and SLUICE_DATABASE__*: validation that names the variable, secrets
from files read when a client is made, TLS contexts, OAUTHBEARER token providers, and
settings that never show a secret."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from aiokafka.abc import AbstractTokenProvider
from pydantic import ValidationError

from common.kafka_security import FileTokenProvider, client_options
from common.settings import KafkaSettings, Settings
from infra.tls import ensure_tls
from sluice.errors import InvalidConfigError


class StaticTokens(AbstractTokenProvider):
    """A token provider a user might name in SLUICE_KAFKA__SASL_OAUTH_TOKEN_PROVIDER."""

    async def token(self) -> str:
        return "static-token"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory):
    return ensure_tls(tmp_path_factory.mktemp("state"))


@pytest.mark.parametrize(("fields", "message"), [
    ({"security_protocol": "SASL_SSL"}, "SLUICE_KAFKA__SASL_MECHANISM"),
    ({"sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p"},
     "SLUICE_KAFKA__SECURITY_PROTOCOL is PLAINTEXT"),
    ({"ssl_cafile": "/ca.pem"}, "SLUICE_KAFKA__SSL_CAFILE is set but"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256",
      "sasl_username": "u"}, "needs SLUICE_KAFKA__SASL_PASSWORD"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u",
      "sasl_username_file": "/u", "sasl_password": "p"}, "not both"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"},
     "SLUICE_KAFKA__SASL_OAUTH_TOKEN_PROVIDER"),
    ({"security_protocol": "SSL", "ssl_keyfile": "/k"}, "needs SLUICE_KAFKA__SSL_CERTFILE"),
])
def test_inconsistent_settings_name_the_variable(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KafkaSettings(**fields)


def test_environment_and_secret_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      tls) -> None:
    """From the environment as a pod gets it; the password file is read each time
    options are built (a rotated Secret takes effect at the next client)."""
    password = tmp_path / "password"
    password.write_text("first\n")
    env = {"SLUICE_KAFKA_BOOTSTRAP": "b:9093", "SLUICE_DATABASE_URL": "postgresql://x",
           "SLUICE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
           "SLUICE_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
           "SLUICE_KAFKA__SASL_USERNAME": "sluice-worker",
           "SLUICE_KAFKA__SASL_PASSWORD_FILE": str(password),
           "SLUICE_KAFKA__SSL_CAFILE": str(tls.ca_cert),
           "SLUICE_KAFKA__SSL_CERTFILE": "",  # empty means unset
           "SLUICE_KAFKA__COMPRESSION": "zstd"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings.load()
    options = settings.kafka_options()
    assert options["security_protocol"] == "SASL_SSL"
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (options["sasl_plain_username"], options["sasl_plain_password"]) == (
        "sluice-worker", "first")
    assert options["ssl_context"].check_hostname
    assert options["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    assert settings.producer_options()["compression_type"] == "zstd"
    password.write_text("rotated\n")
    assert settings.kafka_options()["sasl_plain_password"] == "rotated"
    password.unlink()
    with pytest.raises(InvalidConfigError, match="SLUICE_KAFKA__SASL_PASSWORD_FILE"):
        settings.kafka_options()


def test_mutual_tls_and_hostname_checks(tls) -> None:
    options = client_options(KafkaSettings(
        security_protocol="SSL", ssl_cafile=tls.ca_cert, ssl_certfile=tls.client_cert,
        ssl_keyfile=tls.client_key, ssl_check_hostname=False))
    assert options == {"security_protocol": "SSL", "ssl_context": options["ssl_context"]}
    assert not options["ssl_context"].check_hostname
    with pytest.raises(InvalidConfigError, match="SLUICE_KAFKA__SSL_CERTFILE"):
        client_options(KafkaSettings(security_protocol="SSL", ssl_certfile=tls.ca_cert,
                                     ssl_keyfile=tls.client_key))  # key of another cert
    with pytest.raises(InvalidConfigError, match="SLUICE_KAFKA__SSL_CAFILE"):
        client_options(KafkaSettings(security_protocol="SSL", ssl_cafile=tls.client_key))


async def test_oauthbearer_token_providers(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("eyJhbGciOi.first\n")
    options = client_options(KafkaSettings(security_protocol="SASL_SSL",
                                           sasl_mechanism="OAUTHBEARER",
                                           sasl_oauth_token_file=token))
    provider = options["sasl_oauth_token_provider"]
    assert isinstance(provider, FileTokenProvider)
    assert await provider.token() == "eyJhbGciOi.first"
    token.write_text("eyJhbGciOi.renewed\n")
    assert await provider.token() == "eyJhbGciOi.renewed"

    hooked = client_options(KafkaSettings(
        security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER",
        sasl_oauth_token_provider="tests.unit.test_kafka_security:StaticTokens"))
    assert await hooked["sasl_oauth_token_provider"].token() == "static-token"
    for bad in ("tests.unit.test_kafka_security:Missing", "tests.unit.test_kafka_security:ssl"):
        with pytest.raises(InvalidConfigError, match="SLUICE_KAFKA__SASL_OAUTH_TOKEN_PROVIDER"):
            client_options(KafkaSettings(security_protocol="SASL_SSL",
                                         sasl_mechanism="OAUTHBEARER",
                                         sasl_oauth_token_provider=bad))


def test_database_ca_setting_and_no_secret_in_repr(tls) -> None:
    settings = Settings(kafka_bootstrap="b:9092",
                        database_url="postgresql://sluice:s3cret@db:5432/sluice",
                        kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN",
                               "sasl_username": "u", "sasl_password": "kafka-s3cret"},
                        database={"ssl_cafile": str(tls.ca_cert)})
    dsn = settings.database_dsn()
    assert "sslmode=verify-full" in dsn and f"sslrootcert={tls.ca_cert}".replace(
        "/", "%2F") in dsn
    kept = settings.model_copy(update={"database_url": "postgresql://h/db?sslmode=verify-ca"})
    assert "sslmode=verify-ca" in kept.database_dsn()
    shown = repr(settings) + str(settings)
    assert "s3cret" not in shown and "kafka-s3cret" not in shown
