"""A local Jaeger for traces: the v2 all-in-one (OTLP receiver, memory storage, query API).

Built once from the Go module proxy and cached (`<cache>/go-bin/jaeger-<version>/`,
cache = SLUICE_CACHE_DIR or ~/.cache/sluice), so only the first build is slow
(minutes on two cores; `.ci/run` does it, not `make setup`). `go install module@version`
refuses this module (its go.mod has a replace directive), so the module is downloaded and
`cmd/jaeger` built inside it: the same pinned sources and checksums.

    python -m infra.jaeger build                      # the cached binary's path
    python -m infra.jaeger run --otlp-port 4318 --query-port 16686
    python -m infra.jaeger show TRACE_ID --query-port 16686   # a trace as a tree

`start` runs one on loopback ports of the caller's choosing, with a config of
its own (OTLP over HTTP only, traces in memory, the query HTTP API and its gRPC
port on loopback), and waits until the query API answers; the tests start one
per run as they start Kafka and PostgreSQL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.common import LOOPBACK, InfraError, default_cache_dir, free_port, stop_pid

VERSION = "v1.75.0"
MODULE = "github.com/jaegertracing/jaeger"

_CONFIG = """\
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:  # Jaeger's own: no metrics port, no traces of itself
    metrics:
      level: none
    traces:
      level: none
    logs:
      level: warn
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
  jaeger_query:
    enable_tracing: false
    storage:
      traces: memstore
    http:
      endpoint: {host}:{query_port}
    grpc:
      endpoint: {host}:{query_grpc_port}
receivers:
  otlp:
    protocols:
      http:
        endpoint: {host}:{otlp_port}
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


def cache_dir() -> Path:
    return Path(os.environ.get("SLUICE_CACHE_DIR") or default_cache_dir())


def binary_path() -> Path:
    return cache_dir() / "go-bin" / f"jaeger-{VERSION}" / "jaeger"


def ensure_binary() -> Path:
    """The cached `jaeger` binary, built first if missing; InfraError says why not."""
    binary = binary_path()
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    gopath = cache_dir() / "go-bin"
    env = {**os.environ, "GOPATH": str(gopath), "GOFLAGS": "-buildvcs=false",
           "GOPROXY": _module_proxy()}
    started = time.monotonic()
    print(f"building jaeger {VERSION} from the Go module proxy (once; cached in "
          f"{binary.parent})", flush=True)
    download = _go(["mod", "download", "-json", f"{MODULE}@{VERSION}"], env)
    source = Path(json.loads(download)["Dir"])
    partial = binary.with_name("jaeger.partial")  # never taken for a finished build
    binary.parent.mkdir(parents=True, exist_ok=True)
    _go(["build", "-trimpath", "-o", str(partial), "./cmd/jaeger"], env, cwd=source)
    partial.replace(binary)
    print(f"built jaeger in {time.monotonic() - started:.0f} s", flush=True)
    return binary


def _module_proxy() -> str:
    """GOPROXY without `direct`: modules come from the proxy, never from source hosts."""
    proxy = _go(["env", "GOPROXY"], dict(os.environ)).strip()
    proxies = [p for p in proxy.replace("|", ",").split(",") if p and p not in ("direct", "off")]
    if not proxies:
        raise InfraError(f"GOPROXY ({proxy!r}) names no module proxy; jaeger is built from "
                         "one")
    return ",".join(proxies)


def _go(args: list[str], env: dict[str, str], cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(["go", *args], env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=1800)
    except FileNotFoundError:
        raise InfraError("`go` was not found on PATH: it builds jaeger from the Go module "
                         "proxy (install Go 1.24 or later)") from None
    if done.returncode != 0:
        raise InfraError(f"`go {' '.join(args)}` failed:\n{done.stderr[-3000:]}")
    return done.stdout


@dataclass
class Jaeger:
    """A running Jaeger: where spans go (OTLP over HTTP) and where they are read."""

    process: subprocess.Popen[bytes]
    otlp_port: int
    query_port: int
    log_path: Path

    @property
    def otlp_endpoint(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT for it (the exporter appends /v1/traces)."""
        return f"http://{LOOPBACK}:{self.otlp_port}"

    @property
    def query_url(self) -> str:
        return f"http://{LOOPBACK}:{self.query_port}"

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        return trace_at(self.query_url, trace_id)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            stop_pid(self.process.pid, signal.SIGTERM, 10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)


def trace_at(query_url: str, trace_id: str) -> dict[str, Any] | None:
    """The trace as the query API returns it (`/api/traces/{id}`), None if unknown."""
    try:
        with urllib.request.urlopen(f"{query_url}/api/traces/{trace_id}", timeout=5) as resp:
            data = json.loads(resp.read())["data"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
    return data[0] if data else None


def start(state_dir: Path, otlp_port: int | None = None, query_port: int | None = None,
          wait_s: float = 60.0) -> Jaeger:
    """Start Jaeger on loopback (free ports unless given); returns once it answers."""
    binary = ensure_binary()
    state_dir.mkdir(parents=True, exist_ok=True)
    otlp_port = otlp_port or free_port()
    query_port = query_port or free_port()
    config = state_dir / "jaeger.yaml"
    config.write_text(_CONFIG.format(host=LOOPBACK, otlp_port=otlp_port, query_port=query_port,
                                     query_grpc_port=free_port()))
    log_path = state_dir / "jaeger.log"
    # Its own OpenTelemetry SDK sends nothing anywhere (the caller's OTEL_* stay out).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
           "OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "none"}
    with log_path.open("wb") as log:
        process = subprocess.Popen([str(binary), "--config", f"file:{config}"], stdout=log,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    jaeger = Jaeger(process, otlp_port, query_port, log_path)
    deadline = time.monotonic() + wait_s
    while not _answers(f"{jaeger.query_url}/api/services"):
        if process.poll() is not None or time.monotonic() > deadline:
            jaeger.stop()
            raise InfraError(f"jaeger did not start (exit code {process.poll()}):\n"
                             f"{jaeger.log()}")
        time.sleep(0.2)
    return jaeger


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def render(trace: dict[str, Any]) -> str:
    """A trace from the query API as an indented tree: offset and duration (ms), span,
    service, and how many events it holds (this build has no web UI: its assets are
    not in the module)."""
    spans, processes = trace["spans"], trace["processes"]
    ids = {span["spanID"] for span in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        parents = [r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"]
        parent = parents[0] if parents and parents[0] in ids else None
        children.setdefault(parent, []).append(span)
    t0 = min(span["startTime"] for span in spans)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s["startTime"]):
            events = f"  ({len(span['logs'])} events)" if span["logs"] else ""
            service = processes[span["processID"]]["serviceName"]
            lines.append(f"{(span['startTime'] - t0) / 1000:9.2f} {span['duration'] / 1000:9.2f}"
                         f"  {'  ' * depth}{span['operationName']} [{service}]{events}")
            walk(span["spanID"], depth + 1)

    walk(None, 0)
    return "\n".join(["  at (ms) took (ms)  span [service]", *lines])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m infra.jaeger", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build (once) and print the cached binary's path")
    run = sub.add_parser("run", help="run one in the foreground until interrupted")
    run.add_argument("--otlp-port", type=int, default=4318)
    run.add_argument("--query-port", type=int, default=16686)
    run.add_argument("--state-dir", type=Path, default=cache_dir() / "jaeger")
    show = sub.add_parser("show", help="print a trace of a running one as a tree")
    show.add_argument("trace_id")
    show.add_argument("--query-port", type=int, default=16686)
    args = parser.parse_args()
    if args.command == "build":
        print(ensure_binary())
        return
    if args.command == "show":
        found = trace_at(f"http://{LOOPBACK}:{args.query_port}", args.trace_id)
        print(render(found) if found else f"no trace {args.trace_id}")
        return
    jaeger = start(args.state_dir, args.otlp_port, args.query_port)
    print(f"OTEL_EXPORTER_OTLP_ENDPOINT={jaeger.otlp_endpoint}\n"
          f"traces: {jaeger.query_url}/api/traces/<trace id> (Ctrl-C stops it)", flush=True)
    # Its own session: stopped with this process however that ends (Ctrl-C, SIGTERM).
    signal.signal(signal.SIGTERM, lambda _signum, _frame: jaeger.stop())
    try:
        jaeger.process.wait()
    except KeyboardInterrupt:
        jaeger.stop()


if __name__ == "__main__":
    main()
