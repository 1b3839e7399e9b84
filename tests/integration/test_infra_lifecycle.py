"""`sluice infra up` twice, status, down, status — on a private state dir and ports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _sluice(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args], capture_output=True, text=True, env=env,
        timeout=180, check=False,
    )


def test_up_twice_status_down_status(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SLUICE_STATE_DIR": str(tmp_path / "state"),
        "SLUICE_INFRA_KAFKA_PORT": "39192",
        "SLUICE_INFRA_KAFKA_CONTROLLER_PORT": "39193",
        "SLUICE_INFRA_POSTGRES_PORT": "39532",
    }
    try:
        first = _sluice("infra", "up", env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        pids_before = orjson.loads(_sluice("infra", "status", "--json", env=env).stdout)
        second = _sluice("infra", "up", env=env)
        assert second.returncode == 0, second.stdout + second.stderr

        status = orjson.loads(_sluice("infra", "status", "--json", env=env).stdout)
        assert status["kafka"]["up"] is True
        assert status["kafka"]["bootstrap"] == "127.0.0.1:39192"
        assert status["kafka"]["version"].startswith("4.")
        assert status["postgres"]["up"] is True
        assert status["postgres"]["url"].startswith("postgresql://")
        assert ":39532/" in status["postgres"]["url"]
        # The second `up` was a no-op: the same processes still serve.
        assert status["kafka"]["pid"] == pids_before["kafka"]["pid"]
        assert status["postgres"]["pid"] == pids_before["postgres"]["pid"]
        cmdline = Path(f"/proc/{status['kafka']['pid']}/cmdline").read_bytes()
        assert b"kafka.Kafka" in cmdline and b"java" in cmdline

        env_out = _sluice("infra", "env", env=env).stdout.splitlines()
        assert env_out[0] == "export SLUICE_KAFKA_BOOTSTRAP=127.0.0.1:39192"
        assert env_out[1].startswith("export SLUICE_DATABASE_URL='postgresql://")
    finally:
        down = _sluice("infra", "down", env=env)
    assert down.returncode == 0, down.stderr
    after = orjson.loads(_sluice("infra", "status", "--json", env=env).stdout)
    assert after["kafka"]["up"] is False
    assert after["postgres"]["up"] is False


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
