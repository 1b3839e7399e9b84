"""The Helm chart: infra/helm/check.sh passes (lint, render, kubeconform), and
the rendered manifests wire pools, models, KEDA, topics and GPUs as intended."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.settings import Settings
from common.topics import request_topic, shared_topics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "infra" / "helm" / "check.sh"
CACHE = Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice"))

Manifest = dict[str, Any]


def _tools_available() -> bool:
    cached = list((CACHE / "go-bin").glob("helm-*/helm"))
    return shutil.which("go") is not None or bool(cached)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Manifest]]:
    if not _tools_available():
        pytest.skip("neither go (to build helm and kubeconform) nor cached binaries")
    out = tmp_path_factory.mktemp("helm")
    # The first run builds helm and kubeconform from source: minutes on two cores.
    proc = subprocess.run(["bash", str(CHECK), "--out", str(out)], capture_output=True,
                          text=True, timeout=3600, check=False)
    assert proc.returncode == 0, f"check.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return {
        name: [d for d in yaml.safe_load_all((out / f"render-{name}.yaml").read_text()) if d]
        for name in ("default", "single-pool", "two-pools", "plain")
    }


def of_kind(docs: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workers(docs: list[Manifest]) -> dict[str, Manifest]:
    """The worker workloads, StatefulSets or Deployments (never both in one render)."""
    stateful, plain = of_kind(docs, "StatefulSet"), of_kind(docs, "Deployment")
    assert not (stateful and plain)
    return stateful or plain


def worker_container(deployment: Manifest) -> Manifest:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def pool_model(deployment: Manifest) -> tuple[str, str]:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return labels["sluice.dev/pool"], labels["sluice.dev/model"]


def one_per_worker(rendered: dict[str, list[Manifest]], kind: str
                   ) -> Iterator[tuple[str, Manifest, Manifest]]:
    """(workload name, workload, its `kind` object) in every rendering, after checking
    that the `kind` objects and the worker workloads pair up one to one by name."""
    for name in ("default", "single-pool", "two-pools"):
        deployments = workers(rendered[name])
        objects = of_kind(rendered[name], kind)
        assert objects.keys() == deployments.keys()
        for dep_name, obj in objects.items():
            yield dep_name, deployments[dep_name], obj


def test_one_workload_per_pool_and_model(rendered: dict[str, list[Manifest]]) -> None:
    pairs = sorted(pool_model(d) for d in workers(rendered["two-pools"]).values())
    assert pairs == [("pool-a", "llama-70b"), ("pool-a", "llama-8b"), ("pool-b", "llama-70b")]
    assert [pool_model(d) for d in workers(rendered["single-pool"]).values()] == [
        ("pool-1", "llama-8b")]


def test_statefulsets_by_default_deployments_on_request(
    rendered: dict[str, list[Manifest]],
) -> None:
    """StatefulSet pod names are stable, and the worker's static group member id is
    built from the hostname: a restarted pod gets its partitions back."""
    for name in ("default", "single-pool", "two-pools"):
        sets = of_kind(rendered[name], "StatefulSet")
        services = of_kind(rendered[name], "Service")
        assert sets and services.keys() == sets.keys()
        for set_name, sts in sets.items():
            assert sts["spec"]["serviceName"] == set_name
            assert sts["spec"]["podManagementPolicy"] == "Parallel"
            assert services[set_name]["spec"]["clusterIP"] == "None"
            assert services[set_name]["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        for so in of_kind(rendered[name], "ScaledObject").values():
            assert so["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    plain = rendered["plain"]
    assert of_kind(plain, "Deployment") and not of_kind(plain, "StatefulSet")
    assert not of_kind(plain, "Service") and not of_kind(plain, "ScaledObject")
    for dep in of_kind(plain, "Deployment").values():
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        assert dep["spec"]["replicas"] == 1


def test_worker_command_env_probes_and_scrape(rendered: dict[str, list[Manifest]]) -> None:
    for dep in workers(rendered["two-pools"]).values():
        pool, model = pool_model(dep)
        c = worker_container(dep)
        assert c["command"] == ["sluice"]
        args = c["args"]
        assert args[:7] == ["worker", "--model", model, "--pool", pool, "--device", "cuda"]
        assert args[7] == "--tp"
        env = {e["name"]: e for e in c["env"]}
        assert env["SLUICE_POOL"]["value"] == pool
        assert env["SLUICE_TOPIC_PREFIX"]["value"] == "sluice"
        assert env["SLUICE_KAFKA_BOOTSTRAP"]["value"] == "kafka-bootstrap.kafka.svc:9093"
        assert env["SLUICE_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
            "name": "sluice-database", "key": "url"}
        assert env["SLUICE_SERVER__TIMEOUT_SECONDS"]["value"] == "60"
        assert env["SLUICE_CLIENT__TIMEOUT_SECS"]["value"] == "60"
        assert "SLUICE_REPLY_TOPIC_PATTERN" in env
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == env["SLUICE_METRICS_PORT"]["value"] == "9400"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert "replicas" not in dep["spec"]  # KEDA owns the replica count


def test_kafka_and_database_security_come_from_secrets_as_files(
    rendered: dict[str, list[Manifest]]
) -> None:
    """SASL_SSL settings reach the workers as the SLUICE_KAFKA__* environment, every
    secret as a mounted file (never a value in the pod spec); PostgreSQL's CA too."""
    from common.settings import KafkaSettings

    for dep in workers(rendered["two-pools"]).values():
        c = worker_container(dep)
        env = {e["name"]: e.get("value") for e in c["env"]}
        security = {k: v for k, v in env.items() if k.startswith("SLUICE_KAFKA__")}
        assert security == {
            "SLUICE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
            "SLUICE_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
            "SLUICE_KAFKA__SASL_USERNAME": "sluice-worker",
            "SLUICE_KAFKA__SASL_PASSWORD_FILE": "/etc/sluice/kafka/password",
            "SLUICE_KAFKA__SSL_CAFILE": "/etc/sluice/kafka/ca.pem",
        }
        # The workers' own settings accept exactly these.
        KafkaSettings(**{k.removeprefix("SLUICE_KAFKA__").lower(): v
                         for k, v in security.items()})
        assert env["SLUICE_DATABASE__SSL_CAFILE"] == "/etc/sluice/database/ca.pem"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["kafka-secrets"] == "/etc/sluice/kafka"
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        sources = volumes["kafka-secrets"]["projected"]["sources"]
        assert {"name": "sluice-kafka", "items": [
            {"key": "password", "path": "password", "mode": 0o400}]} in [
            src["secret"] for src in sources]
    for dep in workers(rendered["default"]).values():
        env = {e["name"]: e.get("value") for e in worker_container(dep)["env"]}
        assert env["SLUICE_KAFKA__SECURITY_PROTOCOL"] == "PLAINTEXT"
        assert "SLUICE_KAFKA__SASL_MECHANISM" not in env


def test_gpu_resources_follow_tp(rendered: dict[str, list[Manifest]]) -> None:
    expected = {("pool-a", "llama-70b"): 4, ("pool-a", "llama-8b"): 1, ("pool-b", "llama-70b"): 8}
    for dep in workers(rendered["two-pools"]).values():
        c = worker_container(dep)
        gpus = expected[pool_model(dep)]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert c["args"][c["args"].index("--tp") + 1] == str(gpus)
    (single,) = workers(rendered["single-pool"]).values()
    resources = worker_container(single)["resources"]
    assert resources["limits"] == {"memory": "96Gi", "nvidia.com/gpu": 1}
    assert resources["requests"]["cpu"] == "8"


def test_a_scaled_object_per_worker_workload(rendered: dict[str, list[Manifest]]) -> None:
    for dep_name, dep, so in one_per_worker(rendered, "ScaledObject"):
        _, model = pool_model(dep)
        assert so["spec"]["scaleTargetRef"]["name"] == dep_name
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "kafka"
        meta = trigger["metadata"]
        assert meta["consumerGroup"] == f"sluice.{model}"
        assert meta["topic"] == f"sluice.requests.{model}"
        assert meta["lagThreshold"].isdigit()
        assert meta["activationLagThreshold"].isdigit()
    scaled = of_kind(rendered["two-pools"], "ScaledObject")
    small = next(so for so in scaled.values() if "llama-8b" in so["metadata"]["name"])
    assert (small["spec"]["minReplicaCount"], small["spec"]["maxReplicaCount"]) == (0, 8)
    assert small["spec"]["triggers"][0]["authenticationRef"] == {"name": "sluice-kafka-auth"}


def test_pdb_per_worker_workload(rendered: dict[str, list[Manifest]]) -> None:
    for _, dep, pdb in one_per_worker(rendered, "PodDisruptionBudget"):
        assert pdb["spec"]["selector"] == dep["spec"]["selector"]
        assert pdb["spec"]["maxUnavailable"] == 1


def _topic_script(docs: list[Manifest]) -> list[str]:
    (job,) = of_kind(docs, "Job").values()
    hooks = job["metadata"]["annotations"]["helm.sh/hook"].split(",")
    assert sorted(hooks) == ["pre-install", "pre-upgrade"]  # before any worker
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return [line.strip() for line in container["args"][0].splitlines()
            if line.strip().startswith("create ")]


def test_topic_job_matches_sluice_topics(rendered: dict[str, list[Manifest]]) -> None:
    """The Job creates what common/topics.py would, with the same configs."""
    lines = _topic_script(rendered["default"])
    settings = Settings(kafka_bootstrap="unused:9092", database_url="postgresql://unused",
                        topic_prefix="sluice")
    specs = [*shared_topics(settings), request_topic(settings, "tiny", 8)]
    assert len(lines) == len(specs)
    for spec, line in zip(specs, lines, strict=True):
        words = line.split()
        assert words[1:3] == [spec.name, str(spec.partitions)]
        configs = dict(w.split("=", 1) for w in words[3:] if w != "--config")
        assert configs == {**spec.configs, "min.insync.replicas": "2"}


def test_topic_job_two_pools(rendered: dict[str, list[Manifest]]) -> None:
    lines = _topic_script(rendered["two-pools"])
    by_topic = {line.split()[1]: line for line in lines}
    assert "cleanup.policy=compact" in by_topic["sluice.control"]
    for model, partitions in (("llama-70b", 16), ("llama-8b", 8)):
        line = by_topic[f"sluice.requests.{model}"]
        assert line.split()[2] == str(partitions)
        assert "message.timestamp.type=LogAppendTime" in line
    assert by_topic["sluice.results"].split()[2] == "16"
    assert {"sluice.timeouts", "sluice.deadletter"} <= by_topic.keys()


def test_monitoring_objects_ship_the_chart_files(rendered: dict[str, list[Manifest]]) -> None:
    """The PrometheusRule is files/alerts.yaml and the dashboard ConfigMap (labelled for
    Grafana's sidecar) files/dashboard.json, unchanged; the PodMonitor scrapes every
    worker's metrics port as the job the rules name. None of them unless enabled."""
    import json

    files = ROOT / "infra" / "helm" / "sluice" / "files"
    docs = rendered["two-pools"]
    (rule,) = of_kind(docs, "PrometheusRule").values()
    assert rule["spec"] == yaml.safe_load((files / "alerts.yaml").read_text())
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (board,) = of_kind(docs, "ConfigMap").values()
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["annotations"] == {"grafana_folder": "sluice"}
    assert json.loads(board["data"]["sluice.json"]) == json.loads(
        (files / "dashboard.json").read_text())
    (monitor,) = of_kind(docs, "PodMonitor").values()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert {"targetLabel": "job", "replacement": "sluice-worker"} in endpoint["relabelings"]
    assert 'up{job="sluice-worker"}' in str(rule["spec"])
    for dep in workers(docs).values():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"]: p["containerPort"] for p in worker_container(dep)["ports"]}
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    for name in ("default", "single-pool", "plain"):
        kinds = {d["kind"] for d in rendered[name]}
        assert not kinds & {"PrometheusRule", "PodMonitor", "ConfigMap"}, name
