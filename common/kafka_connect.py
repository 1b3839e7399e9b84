"""Connecting a Kafka client, and saying in one line why it could not.

aiokafka reports any failed bootstrap as "Unable to bootstrap"; `diagnose`
connects to each bootstrap server directly to find the reason (a refused
login, an untrusted certificate, TLS where plaintext was expected, ...) and
names the setting to fix; `connect` runs a client's `start()` with it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from common.errors import KafkaAccessError
from common.kafka_security import ENV, TLS_PROTOCOLS, explain, principal
from common.settings import Settings
from common.timeouts import dependency_call

T = TypeVar("T")
log = logging.getLogger(__name__)


async def diagnose(settings: Settings, original: BaseException | None = None) -> str:
    """Why no connection to Kafka can be made, found by connecting to each bootstrap
    server directly (aiokafka reports only "Unable to bootstrap"): one line naming
    the setting to fix."""
    from aiokafka.conn import create_conn
    from aiokafka.errors import (
        KafkaConnectionError,
        SaslAuthenticationFailed,
        UnsupportedSaslMechanismError,
    )

    k = settings.kafka
    options = {key: value for key, value in settings.kafka_options().items()
               if key not in ("bootstrap_servers", "metadata_max_age_ms")}
    timeout_ms = int(min(settings.client.timeout_secs, 30) * 1000)
    servers = [s.strip() for s in str(settings.kafka_bootstrap).split(",") if s.strip()]
    for server in servers:
        host, _, port = server.rpartition(":")
        where = f"Kafka at {server}"
        try:
            conn = await asyncio.wait_for(
                create_conn(host.strip("[]"), int(port), request_timeout_ms=timeout_ms,
                            **options), timeout_ms / 1000)
        except SaslAuthenticationFailed as exc:
            return (f"{where} refused the login of {principal(k)} with {k.sasl_mechanism} "
                    f"({exc.args[0] if exc.args else exc}): check {ENV}SASL_USERNAME and "
                    f"{ENV}SASL_PASSWORD (or their _FILE) and {ENV}SASL_MECHANISM")
        except UnsupportedSaslMechanismError:
            return (f"{where} does not offer SASL mechanism {k.sasl_mechanism}: set "
                    f"{ENV}SASL_MECHANISM to one it enables")
        except ssl.SSLCertVerificationError as exc:
            if "hostname" in str(exc.verify_message) or "IP address mismatch" in str(exc):
                return (f"{where} presented a certificate for another name "
                        f"({exc.verify_message}): connect with a name on its certificate in "
                        f"SLUICE_KAFKA_BOOTSTRAP (or {ENV}SSL_CHECK_HOSTNAME=false, unsafe)")
            return (f"{where} presented a certificate this client does not trust "
                    f"({exc.verify_message}): set {ENV}SSL_CAFILE to the CA that signed it")
        except KafkaConnectionError as exc:
            cause = exc.__cause__
            if isinstance(cause, ssl.SSLError):
                return (f"{where} refused this client's TLS handshake ({cause.reason}): it "
                        f"wants a client certificate its CA signed — set {ENV}SSL_CERTFILE and "
                        f"{ENV}SSL_KEYFILE")
            if k.security_protocol in ("PLAINTEXT", "SASL_PLAINTEXT"):
                return (f"{where} closed the connection at once: it expects TLS; set "
                        f"{ENV}SECURITY_PROTOCOL to SSL or SASL_SSL (with {ENV}SSL_CAFILE)")
            return f"{where} closed the connection: {exc}"
        except (ConnectionResetError, ssl.SSLError) as exc:
            if k.security_protocol in TLS_PROTOCOLS:
                return (f"{where} does not speak TLS there ({type(exc).__name__}): check "
                        f"{ENV}SECURITY_PROTOCOL and the port in SLUICE_KAFKA_BOOTSTRAP")
            return f"{where} reset the connection: {exc}"
        except (OSError, TimeoutError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
                type(exc).__name__
            return (f"{where} cannot be reached ({why}): check SLUICE_KAFKA_BOOTSTRAP and that "
                    "the broker runs (`sluice infra up` for the local one)")
        else:
            conn.close()
    return f"Kafka at {settings.kafka_bootstrap} did not answer: {original or 'no reason given'}"


async def connect(start: Awaitable[T], settings: Settings, what: str) -> T:
    """Await a client's `start()`, bounded by SLUICE_CLIENT__TIMEOUT_SECS; a failure to
    connect, log in or be authorized raises KafkaAccessError with one clear line."""
    from aiokafka.errors import KafkaConnectionError, KafkaError

    try:
        return await dependency_call(f"connecting to Kafka ({what})", start,
                                     settings.client.timeout_secs)
    except KafkaConnectionError as exc:
        raise KafkaAccessError(await diagnose(settings, exc)) from None
    except KafkaError as exc:
        line = explain(exc, settings.kafka, what)
        if line is None:
            raise
        raise KafkaAccessError(line) from None


async def until_available(work: Callable[[], Awaitable[T]], settings: Settings, what: str,
                          on_wait: Callable[[str], None] = lambda _why: None) -> T:
    """`work()`, tried again with backoff while Kafka answers with a retriable error (a
    broker away, a partition's leader being elected: a routine outage, not a reason to
    stop) for up to SLUICE_CLIENT__TIMEOUT_SECS; then that error. `on_wait` hears why
    it waits (the worker's status says it)."""
    from aiokafka.errors import KafkaError

    deadline = time.monotonic() + settings.client.timeout_secs
    backoff_s = 0.5
    while True:
        try:
            return await work()
        except KafkaError as exc:
            if not exc.retriable or time.monotonic() + backoff_s > deadline:
                raise
            why = f"Kafka: {type(exc).__name__}: {exc}"
            log.warning("%s: %s; trying again in %.1f s", what, why, backoff_s)
            on_wait(why)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)
