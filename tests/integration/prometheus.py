"""A real Prometheus (Debian's `prometheus` binary) for tests: its own config and TSDB in
a temporary directory, on a free loopback port, scraping and evaluating every second.

Targets are file-based service discovery, one JSON file per job, so a test adds and
removes targets while Prometheus runs (`set_targets`). `query`, `query_range` and
`alerts` are its HTTP API's; `wait_for` polls one of them without blocking the event
loop (the gateway under test may be serving in it).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.conftest import free_port

T = TypeVar("T")
INTERVAL = "1s"  # scrape and evaluation: alerts fire within seconds of their fault


class Prometheus:
    def __init__(self, workdir: Path, port: int, jobs: list[str]):
        self.workdir = workdir
        self.url = f"http://127.0.0.1:{port}"
        self.jobs = jobs
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    @contextmanager
    def running(cls, workdir: Path, rules: dict[str, Any], jobs: list[str]
                ) -> Iterator[Prometheus]:
        """Prometheus with `rules` (a rules file's content) scraping `jobs`, each from
        `<job>.json` (empty until `set_targets`); stopped on exit."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (infra/system-deps.sh installs "
                               "Debian's package)")
        workdir.mkdir(parents=True, exist_ok=True)
        prom = cls(workdir, free_port(), jobs)
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
        for job in jobs:
            prom.set_targets(job, [])
        config = {
            "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL,
                       "scrape_timeout": INTERVAL},
            "rule_files": [str(workdir / "rules.yaml")],
            "scrape_configs": [{"job_name": job, "file_sd_configs": [
                {"files": [str(workdir / f"{job}.json")], "refresh_interval": INTERVAL}]}
                for job in jobs],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = (workdir / "prometheus.log").open("wb")
        prom.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={prom.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            prom._wait_ready(timeout_s=60)
            yield prom
        finally:
            prom.proc.terminate()
            try:
                prom.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.proc.kill()
                prom.proc.wait()
            log.close()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready in {timeout_s} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-5000:]

    def set_targets(self, job: str, targets: list[str]) -> None:
        """Replace `job`'s targets (host:port). Prometheus reads the file at once but hands
        discovered targets to its scrapers at most every 5 s: see `scraped`."""
        path = self.workdir / f"{job}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": targets, "labels": {}}] if targets else []))
        tmp.replace(path)  # never a half-written file

    # ---- the HTTP API (blocking; see `wait_for`) -------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc.code} {exc.read()[:500]!r}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant vector: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float
                    ) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=str(start), end=str(end),
                        step=str(step))["result"]

    def scraped(self) -> dict[str, float]:
        """`up` of every target scraped now ({instance: 0 or 1})."""
        return {s["metric"]["instance"]: float(s["value"][1]) for s in self.query("up")}

    def firing(self, alert: str) -> list[dict[str, str]]:
        """The label sets of `alert`'s firing instances."""
        return [a["labels"] for a in self.api("alerts")["alerts"]
                if a["labels"]["alertname"] == alert and a["state"] == "firing"]

    def value(self, expr: str) -> float | None:
        """The value of a one-series instant query, None when it has none."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    async def wait_for(self, check: Callable[[], T], what: str, timeout_s: float = 60
                       ) -> T:
        """`check()`'s first truthy result, polled twice a scrape interval."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = await asyncio.to_thread(check)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s} s\n{self.log()}")
            await asyncio.sleep(0.5)


def finite(result: list[dict[str, Any]]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in result) if math.isfinite(v)]
