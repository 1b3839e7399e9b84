"""`sluice infra up` twice, status, down, status — on a private state dir and ports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _sluice(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args], capture_output=True, text=True, env=env,
        timeout=180, check=False,
    )


def test_up_twice_status_down_status(tmp_path: Path) -> None:
    kafka_port, pg_port = free_port(), free_port()
    env = {
        **os.environ,
        "SLUICE_STATE_DIR": str(tmp_path / "state"),
        "SLUICE_INFRA_KAFKA_PORT": str(kafka_port),
        "SLUICE_INFRA_KAFKA_CONTROLLER_PORT": str(free_port()),
        "SLUICE_INFRA_POSTGRES_PORT": str(pg_port),
    }
    try:
        first = _sluice("infra", "up", env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        pids_before = orjson.loads(_sluice("infra", "status", "--json", env=env).stdout)
        second = _sluice("infra", "up", env=env)
        assert second.returncode == 0, second.stdout + second.stderr

        status = orjson.loads(_sluice("infra", "status", "--json", env=env).stdout)
        assert status["kafka"]["up"] is True
        assert status["kafka"]["bootstrap"] == f"127.0.0.1:{kafka_port}"
        assert status["kafka"]["version"].startswith("4.")
        assert status["postgres"]["up"] is True
        assert status["postgres"]["url"].startswith("postgresql://")
        assert f":{pg_port}/" in status["postgres"]["url"]
        # The second `up` was a no-op: the same processes still serve.
        assert status["kafka"]["pid"] == pids_before["kafka"]["pid"]
        assert status["postgres"]["pid"] == pids_before["postgres"]["pid"]
        cmdline = Path(f"/proc/{status['kafka']['pid']}/cmdline").read_bytes()
        assert b"kafka.Kafka" in cmdline and b"java" in cmdline

        lines = _sluice("infra", "env", env=env).stdout.splitlines()
        exports = [line for line in lines if line.startswith("export ")]
        assert exports[0] == f"export SLUICE_KAFKA_BOOTSTRAP=127.0.0.1:{kafka_port}"
        assert exports[1].startswith("export SLUICE_DATABASE_URL='postgresql://")
        # A plaintext broker: any security settings of a secure one are cleared.
        assert "unset SLUICE_KAFKA__SECURITY_PROTOCOL" in lines
        assert status["kafka"]["secure"] is False
    finally:
        down = _sluice("infra", "down", env=env)
    assert down.returncode == 0, down.stderr
    after = orjson.loads(_sluice("infra", "status", "--json", env=env).stdout)
    assert after["kafka"]["up"] is False
    assert after["postgres"]["up"] is False
    # --purge deletes the data too: as root the cluster lives outside the state dir.
    cluster = (Path(env["SLUICE_STATE_DIR"]) / "postgres-cluster").resolve()
    assert cluster.exists()
    purged = _sluice("infra", "down", "--purge", env=env)
    assert purged.returncode == 0, purged.stderr
    assert "data deleted" in purged.stdout
    assert not cluster.exists() and not (Path(env["SLUICE_STATE_DIR"]) / "kafka").exists()


def _rows(cfg) -> list[str]:
    from infra import postgres

    out = subprocess.run(
        [str(postgres.bin_dir() / "psql"), str(postgres.status(cfg)["url"]), "-tAc",
         "SELECT note FROM kept ORDER BY 1"],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_new_state_dir_reaches_the_cluster_left_at_its_path(tmp_path: Path) -> None:
    """A clean checkout's fresh state dir at the same path as an earlier one (CI) finds the
    earlier PostgreSQL cluster (as root it lives outside the state dir) with no password to
    it: `up` sets a new one in single-user mode and the data stays."""
    import shutil

    from infra import postgres
    from infra.common import InfraConfig

    cfg = InfraConfig.from_env(state_dir=tmp_path / "state", postgres_port=free_port())
    paths = postgres._paths(cfg)
    try:
        postgres.up(cfg)
        made = subprocess.run(
            [str(postgres.bin_dir() / "psql"), str(postgres.status(cfg)["url"]), "-c",
             "CREATE TABLE kept (note text); INSERT INTO kept VALUES ('survives')"],
            capture_output=True, text=True, check=False,
        )
        assert made.returncode == 0, made.stderr
        assert postgres.down(cfg)

        # The password is lost: the old layout kept it only in the state dir.
        paths["password"].unlink()
        if paths["root"].is_relative_to(cfg.state_dir):
            paths["link"].unlink(missing_ok=True)
        else:
            shutil.rmtree(cfg.state_dir)
        assert postgres.up(cfg)["up"] is True
        assert _rows(cfg) == ["survives"]

        # A password held that is not the running cluster's (another cluster's, say).
        paths["password"].write_text("not-the-password\n")
        assert postgres.up(cfg)["up"] is True
        assert _rows(cfg) == ["survives"]
        assert paths["password"].read_text().strip() != "not-the-password"
    finally:
        postgres.purge(cfg)
    assert not paths["root"].exists()


def test_taken_port_gives_an_actionable_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        env = {
            **os.environ,
            "SLUICE_STATE_DIR": str(tmp_path / "state"),
            "SLUICE_INFRA_KAFKA_PORT": str(port),
        }
        result = _sluice("infra", "up", env=env)
    assert result.returncode == 1
    assert f"port {port}" in result.stderr and "taken" in result.stderr
    assert "Traceback" not in result.stderr
