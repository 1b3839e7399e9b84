"""sluice on a secure broker (`sluice infra up --secure`): SASL_SSL with SCRAM, mutual
TLS, PostgreSQL over TLS, the Helm README's ACLs enforced by the KRaft
StandardAuthorizer, and one clear line for every way a connection can be refused."""

from __future__ import annotations

import asyncio
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import sluice
from common.settings import KafkaSettings, Settings
from schemas import DoneEvent, TokenEvent
from sluice.errors import KafkaAccessError
from tests.conftest import Endpoints, secure_state_dir
from tests.integration.pipeline_helpers import (
    drop_schema,
    settings_env,
    worker_process,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "infra" / "helm" / "sluice" / "README.md"


def _settings(endpoints: Endpoints, unique_name: str, **kafka: Any) -> Settings:
    return Settings(kafka_bootstrap=endpoints.kafka_bootstrap,
                    database_url=endpoints.database_url, db_schema=unique_name,
                    topic_prefix=unique_name, request_partitions=2,
                    kafka=endpoints.kafka_settings().model_copy(update=kafka))


def _as_user(settings: Settings, user: str, password: str,
             mechanism: str = "SCRAM-SHA-512") -> Settings:
    kafka = settings.kafka.model_copy(update={
        "sasl_mechanism": mechanism, "sasl_username": user, "sasl_password": password,
        "sasl_password_file": None})
    return settings.model_copy(update={"kafka": KafkaSettings.model_validate(kafka.model_dump())})


def _confluent(settings: Settings, **extra: Any) -> dict[str, Any]:
    """The same identity for librdkafka (confluent-kafka)."""
    k = settings.kafka
    conf = {"bootstrap.servers": settings.kafka_bootstrap,
            "security.protocol": k.security_protocol, "ssl.ca.location": str(k.ssl_cafile)}
    if k.sasl_mechanism:
        password = k.sasl_password.get_secret_value() if k.sasl_password else \
            k.sasl_password_file.read_text().strip()
        conf |= {"sasl.mechanism": k.sasl_mechanism, "sasl.username": k.sasl_username,
                 "sasl.password": password}
    return conf | extra


def _create_users(admin_settings: Settings, users: dict[str, str]) -> None:
    from confluent_kafka.admin import (
        AdminClient,
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    admin = AdminClient(_confluent(admin_settings))
    # One credential per user per request (the broker refuses two).
    for mechanism in (ScramMechanism.SCRAM_SHA_256, ScramMechanism.SCRAM_SHA_512):
        upserts = [UserScramCredentialUpsertion(user, ScramCredentialInfo(mechanism, 8192),
                                                password.encode())
                   for user, password in users.items()]
        for future in admin.alter_user_scram_credentials(upserts).values():
            future.result(30)


def readme_acl_commands() -> list[list[str]]:
    """The kafka-acls.sh commands of the Helm README's ACL block, as argument lists."""
    text = README.read_text()
    block = text[text.index("<!-- acls:begin -->"):text.index("<!-- acls:end -->")]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.strip().startswith("kafka-acls.sh"):
            commands.append(shlex.split(line))
    return commands


def _bindings(command: list[str], variables: dict[str, str]) -> list[Any]:
    """confluent-kafka AclBindings for one kafka-acls.sh --add command."""
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    def value(raw: str) -> str:
        return re.sub(r"\$([A-Z]+)", lambda m: variables.get(m.group(1), m.group(0)), raw)

    args = iter(command[1:])
    principal, operations, resources, pattern = "", [], [], ResourcePatternType.LITERAL
    for arg in args:
        if arg == "--allow-principal":
            principal = value(next(args))
        elif arg == "--operation":
            operations.append(getattr(AclOperation, re.sub(r"(?<!^)([A-Z])", r"_\1",
                                                           next(args)).upper()))
        elif arg in ("--topic", "--group", "--transactional-id"):
            kind = {"--topic": ResourceType.TOPIC, "--group": ResourceType.GROUP,
                    "--transactional-id": ResourceType.TRANSACTIONAL_ID}[arg]
            resources.append((kind, value(next(args))))
        elif arg == "--cluster":
            resources.append((ResourceType.BROKER, "kafka-cluster"))
        elif arg == "--resource-pattern-type":
            pattern = ResourcePatternType[next(args).upper()]
        elif arg in ("--bootstrap-server", "--command-config"):
            next(args)
    assert principal and operations and resources, command
    return [AclBinding(kind, name, pattern, principal, "*", operation,
                       AclPermissionType.ALLOW)
            for kind, name in resources for operation in operations]


def apply_readme_acls(admin_settings: Settings, prefix: str, tenants: list[str]) -> int:
    from confluent_kafka.admin import AdminClient

    bindings = []
    for command in readme_acl_commands():
        principal = command[command.index("--allow-principal") + 1]
        for tenant in (tenants if "$TENANT" in principal else [""]):
            bindings += _bindings(command, {"PREFIX": prefix, "TENANT": tenant})
    admin = AdminClient(_confluent(admin_settings))
    for future in admin.create_acls(bindings).values():
        future.result(30)
    return len(bindings)


def _read_denied(settings: Settings, topic: str) -> str:
    """What a tenant's librdkafka consumer (in a group of its own prefix, which it may
    use) gets reading `topic`: READ, or the broker's error."""
    from confluent_kafka import Consumer, KafkaException

    group = f"tenant-{settings.kafka.sasl_username}.probe-{uuid.uuid4().hex[:6]}"
    consumer = Consumer(_confluent(settings, **{
        "group.id": group, "auto.offset.reset": "earliest"}))
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                msg = consumer.poll(0.5)
            except KafkaException as exc:
                return exc.args[0].name()
            if msg is not None and msg.error() is not None:
                return msg.error().name()
            if msg is not None:
                return "READ"
    finally:
        consumer.close()
    return "NOTHING"


async def test_the_pipeline_over_sasl_ssl_and_mutual_tls(
    secure_endpoints, secure_mtls_endpoints, unique_name, tiny_model, tmp_path
) -> None:
    """A worker over SASL_SSL (SCRAM-SHA-512), PostgreSQL over TLS (verify-full), and
    clients over SASL_SSL and over mutual TLS: a streamed multi-turn chat with KV reuse,
    whose logs hold no secret."""
    settings = _settings(secure_endpoints, unique_name)
    state = secure_state_dir(secure_endpoints)
    mtls = _settings(secure_mtls_endpoints, unique_name)
    assert "sslmode=verify-full" in settings.database_url
    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(tiny_model),
                           compute_config={"kv_cache_len": 4096})
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="tiny")
    other = sluice.Client(mtls)
    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            messages = [{"role": "user", "content": "Tell me about the river."}]
            cached = []
            for turn, speaker in enumerate((client, other, client)):
                text, done = "", None
                async with asyncio.timeout(120):
                    async for event in speaker.stream(model="tiny", api_key=key,
                                                      session_id="s-1", messages=messages,
                                                      max_tokens=8):
                        if isinstance(event, TokenEvent):
                            text += event.text
                        else:
                            done = event
                assert isinstance(done, DoneEvent), (done, worker.log())
                assert done.text == text
                cached.append(done.usage.cached_prompt_tokens)
                messages += [{"role": "assistant", "content": done.text},
                             {"role": "user", "content": f"And part {turn}?"}]
            assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
            log = worker.log_path.read_text()
            password = (state / "kafka-secure" / "admin.password").read_text().strip()
            db_password = settings.database_url.split(":")[2].split("@")[0]
            assert password not in log and db_password not in log
    finally:
        await client.aclose()
        await other.aclose()
        await drop_schema(settings)


async def test_the_helm_readme_acls_hold(secure_endpoints, unique_name, tiny_model,
                                         tmp_path) -> None:
    """The README's ACL block, applied as is: the control plane, a worker and two
    tenants each as its own principal (SCRAM). Each tenant is served on its own reply
    topic and can read neither the other's replies nor anyone's requests."""
    admin = _settings(secure_endpoints, unique_name)
    tag = uuid.uuid4().hex[:6]
    tenants = [f"acme{tag}", f"globex{tag}"]
    passwords = {user: uuid.uuid4().hex for user in ["sluice-worker", "sluice-control",
                                                     *tenants]}
    await asyncio.to_thread(_create_users, admin, passwords)
    assert await asyncio.to_thread(apply_readme_acls, admin, unique_name, tenants) >= 20
    control = _as_user(admin, "sluice-control", passwords["sluice-control"], "SCRAM-SHA-256")
    worker_settings = _as_user(admin, "sluice-worker", passwords["sluice-worker"])
    acme, globex = (_as_user(admin, t, passwords[t], "SCRAM-SHA-256") for t in tenants)

    with sluice.Client(control) as ctl:  # topics created, deployment published, as itself
        ctl.models.register(model="tiny", path=str(tiny_model),
                            compute_config={"kv_cache_len": 4096})
        keys = {t: ctl.keys.create(tenant=t, reply_topic_prefix=f"tenant-{t}.") for t in tenants}
        for k in keys.values():
            ctl.keys.grant(k, model="tiny")
    from common.topics import TopicAdmin, TopicSpec

    async with TopicAdmin(admin) as topics:  # the tenants' operator makes their topics
        await topics.ensure([TopicSpec(f"tenant-{t}.replies", 2, {}) for t in tenants])
    clients = {t: sluice.Client(s) for t, s in zip(tenants, (acme, globex), strict=True)}
    try:
        with worker_process(worker_settings, "tiny", tmp_path) as worker:
            for t, client in clients.items():
                done = await asyncio.wait_for(client.complete(
                    model="tiny", api_key=keys[t], prompt_token_ids=[5, 6, 7], max_tokens=3,
                    reply_topic=f"tenant-{t}.replies"), 120)
                assert done.usage.completion_tokens >= 1, worker.log()
            # acme asking for its answers on globex's topic: Kafka says no at once.
            with pytest.raises(KafkaAccessError, match=f"tenant-{tenants[1]}.replies"):
                await asyncio.wait_for(clients[tenants[0]].complete(
                    model="tiny", api_key=keys[tenants[0]], prompt_token_ids=[5],
                    reply_topic=f"tenant-{tenants[1]}.replies"), 30)
            denied = await asyncio.gather(
                asyncio.to_thread(_read_denied, acme, f"tenant-{tenants[1]}.replies"),
                asyncio.to_thread(_read_denied, acme, admin.requests_topic("tiny")),
                asyncio.to_thread(_read_denied, acme, admin.topic("results")))
            assert denied == ["TOPIC_AUTHORIZATION_FAILED"] * 3, denied
            assert await asyncio.to_thread(
                _read_denied, acme, f"tenant-{tenants[0]}.replies") == "READ"

            # Exactly-once delivery needs the block's transactional-id ACL: the worker
            # reloads with a transactional producer and keeps serving.
            with sluice.Client(control) as ctl:
                ctl.models.update_compute_config(model="tiny",
                                                 compute_config={"delivery": "exactly_once"})
            await asyncio.to_thread(worker.wait_for_log, "delivery: exactly once", 120)
            t = tenants[0]
            done = await asyncio.wait_for(clients[t].complete(
                model="tiny", api_key=keys[t], prompt_token_ids=[8, 9], max_tokens=3,
                reply_topic=f"tenant-{t}.replies"), 120)
            assert done.usage.completion_tokens >= 1, worker.log()
            assert worker.proc.poll() is None, worker.log()
    finally:
        for client in clients.values():
            await client.aclose()
        await drop_schema(admin)


async def test_a_worker_denied_its_request_topic_says_so_and_exits(
    secure_endpoints, unique_name, tiny_model, tmp_path
) -> None:
    """A worker whose principal may not read its request topic never idles silently:
    denied at start it exits with one error line naming the topic and where the ACLs
    are listed; denied while it serves (the ACL deleted) it stops within a minute with
    exit code 3 and the same words."""
    from confluent_kafka.admin import AclBindingFilter, AdminClient

    admin = _settings(secure_endpoints, unique_name)
    user = f"worker-{uuid.uuid4().hex[:6]}"
    await asyncio.to_thread(_create_users, admin, {user: "worker-password"})
    bindings, request_bindings = [], []
    for command in readme_acl_commands():
        if "User:sluice-worker" in command:
            made = _bindings([c.replace("sluice-worker", user) for c in command],
                             {"PREFIX": unique_name})
            (request_bindings if "$PREFIX.requests." in command else bindings).extend(made)
    acl_admin = AdminClient(_confluent(admin))
    for future in acl_admin.create_acls(bindings).values():
        future.result(30)
    client = sluice.Client(admin)
    client.models.register(model="tiny", path=str(tiny_model),
                           compute_config={"kv_cache_len": 4096})
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="tiny")
    worker_settings = _as_user(admin, user, "worker-password")
    denial = f"Kafka denied User:{user} access to topic {unique_name}.requests.tiny"
    try:
        with worker_process(worker_settings, "tiny", tmp_path) as worker:
            code = await asyncio.to_thread(worker.proc.wait, 120)
            log = worker.log_path.read_text()
        assert code != 0, log
        assert [line for line in log.splitlines() if line.startswith("error: ")] == [
            next(line for line in log.splitlines() if denial in line)], log
        assert "infra/helm/sluice/README.md" in log

        for future in acl_admin.create_acls(request_bindings).values():
            future.result(30)
        with worker_process(worker_settings, "tiny", tmp_path) as worker:
            done = await asyncio.wait_for(client.complete(
                model="tiny", api_key=key, prompt_token_ids=[5, 6], max_tokens=2), 120)
            assert done.usage.completion_tokens >= 1
            for future in acl_admin.delete_acls(
                    [AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal,
                                      b.host, b.operation, b.permission_type)
                     for b in request_bindings]).values():
                future.result(30)
            code = await asyncio.to_thread(worker.proc.wait, 90)
            log = worker.log_path.read_text()
        assert code == 3, log
        errors = [line for line in log.splitlines() if '"level":"error"' in line]
        assert any(denial in line and "exit code 3" in line for line in errors), log
    finally:
        await client.aclose()
        await drop_schema(admin)


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**settings_env(settings), "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "sluice", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def _one_line(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "Traceback" not in out, out
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(result.stderr.strip().splitlines()) == 1, out
    assert all(f in errors[0] for f in fragments), out
    return errors[0]


async def test_refused_connections_get_one_line_naming_the_setting(
    secure_endpoints, secure_mtls_endpoints, unique_name, tmp_path
) -> None:
    """A wrong password, an untrusted certificate, no client certificate, plaintext
    to a TLS port, and PostgreSQL without TLS or with a wrong password: the CLI,
    the SDK and a worker each say so in one line, within seconds."""
    good = _settings(secure_endpoints, unique_name)
    cases = {
        "wrong password": (_as_user(good, "admin", "not-the-password"),
                           ("refused the login of User:admin", "SLUICE_KAFKA__SASL_PASSWORD")),
        "untrusted certificate": (
            good.model_copy(update={"kafka": good.kafka.model_copy(update={"ssl_cafile": None})}),
            ("certificate this client does not trust", "SLUICE_KAFKA__SSL_CAFILE")),
        "no client certificate": (
            _settings(secure_mtls_endpoints, unique_name).model_copy(update={
                "kafka": KafkaSettings(security_protocol="SSL",
                                       ssl_cafile=secure_mtls_endpoints.kafka_settings().ssl_cafile)}),
            ("wants a client certificate", "SLUICE_KAFKA__SSL_CERTFILE")),
        "plaintext to TLS": (
            good.model_copy(update={"kafka": KafkaSettings()}),
            ("expects TLS", "SLUICE_KAFKA__SECURITY_PROTOCOL")),
    }
    db_password = good.database_url.split(":")[2].split("@")[0]
    no_tls = good.database_url.split("?")[0] + "?sslmode=disable"
    wrong_db = good.database_url.replace(f":{db_password}@", ":wrong@")
    db_cases = {
        "database without TLS": (good.model_copy(update={"database_url": no_tls}),
                                 ("accepts only TLS connections", "sslmode=verify-full")),
        "database password": (good.model_copy(update={"database_url": wrong_db}),
                              ("refused the password of user 'sluice'",
                               "SLUICE_DATABASE_URL")),
    }
    for name, (settings, fragments) in {**cases, **db_cases}.items():
        started = time.monotonic()
        result = await asyncio.to_thread(_cli, settings, "models", "list")
        line = _one_line(result, *fragments)
        assert time.monotonic() - started < 30, name
        assert "not-the-password" not in line and db_password not in line
    for name, (settings, fragments) in cases.items():
        client = sluice.Client(settings)
        try:
            with pytest.raises(KafkaAccessError) as info:
                await asyncio.wait_for(client.complete(model="tiny", prompt="hi"), 30)
            assert all(f in str(info.value) for f in fragments), (name, info.value)
        finally:
            await client.aclose()
    settings, fragments = cases["wrong password"]
    with worker_process(settings, "tiny", tmp_path) as worker:
        code = await asyncio.to_thread(worker.proc.wait, 60)
        log = worker.log_path.read_text()
    assert code != 0 and "Traceback" not in log, log
    assert all(f in log for f in fragments), log


def test_infra_cli_reports_and_guards_the_secure_broker(secure_cfg) -> None:
    """`status`, `env` and `env --mtls` describe the secure broker (a password file, never
    the password); a plaintext `up` on its ports is refused with what to do."""
    import json
    import os

    env = {**os.environ, "SLUICE_STATE_DIR": str(secure_cfg.state_dir),
           "SLUICE_INFRA_KAFKA_PORT": str(secure_cfg.kafka_port),
           "SLUICE_INFRA_KAFKA_CONTROLLER_PORT": str(secure_cfg.kafka_controller_port),
           "SLUICE_INFRA_KAFKA_TLS_PORT": str(secure_cfg.kafka_tls_port),
           "SLUICE_INFRA_POSTGRES_PORT": str(secure_cfg.postgres_port), "COLUMNS": "300"}
    env.pop("SLUICE_INFRA_SECURE", None)

    def sluice_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sluice", "infra", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    status = json.loads(sluice_cli("status", "--json").stdout)
    assert status["kafka"]["secure"] and status["kafka"]["security_protocol"] == "SASL_SSL"
    assert status["postgres"]["secure"] and "sslmode=verify-full" in status["postgres"]["url"]
    sasl = sluice_cli("env").stdout
    password = (secure_cfg.state_dir / "kafka-secure" / "admin.password").read_text().strip()
    assert "export SLUICE_KAFKA__SECURITY_PROTOCOL=SASL_SSL" in sasl
    assert "export SLUICE_KAFKA__SASL_PASSWORD_FILE=" in sasl and password not in sasl
    assert "unset SLUICE_KAFKA__SSL_CERTFILE" in sasl
    mtls = sluice_cli("env", "--mtls").stdout
    assert f"export SLUICE_KAFKA_BOOTSTRAP=127.0.0.1:{secure_cfg.kafka_tls_port}" in mtls
    assert "export SLUICE_KAFKA__SSL_CERTFILE=" in mtls
    assert "unset SLUICE_KAFKA__SASL_MECHANISM" in mtls
    plain = sluice_cli("up")
    assert plain.returncode == 1
    assert "runs secure on these ports" in plain.stderr and "sluice infra down" in plain.stderr
