"""`sluice worker --model KEY [--pool P] [--device cpu|cuda] [--tp N]`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import subprocess
import sys
from typing import Annotated

import typer

from cli.common import fail, friendly_errors


def register(app: typer.Typer) -> None:
    @app.command("worker")
    @friendly_errors
    def worker_cmd(
        model: Annotated[str, typer.Option("--model", help="The model's key.")],
        pool: Annotated[str | None, typer.Option("--pool", help="Compute pool (SLUICE_POOL).")]
        = None,
        device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
        tp: Annotated[int | None, typer.Option("--tp", help="Ranks per replica.")] = None,
        replica: Annotated[int | None, typer.Option(
            "--replica", min=0, help="Replica index on this host (default: the lowest one no "
            "live worker of this pool holds). Two live workers never share one.")] = None,
        instance_id: Annotated[str | None, typer.Option(
            "--instance-id", help="Static group member id (default pool-host-replica).")] = None,
        max_batched_tokens: Annotated[int, typer.Option(
            "--max-batched-tokens", min=1, help="Token budget of one model step.")] = 512,
        memory_budget_gib: Annotated[float | None, typer.Option(
            "--memory-budget-gib", help="Device memory the model may use (default: free).")]
        = None,
        kafka_bootstrap: Annotated[str | None, typer.Option(
            "--kafka-bootstrap", help="Kafka bootstrap servers (SLUICE_KAFKA_BOOTSTRAP).")]
        = None,
        database_url: Annotated[str | None, typer.Option(
            "--database-url", help="PostgreSQL URL (SLUICE_DATABASE_URL).")] = None,
        metrics_port: Annotated[int | None, typer.Option(
            "--metrics-port", help="Prometheus port (SLUICE_METRICS_PORT; 0 = any free).")]
        = None,
        adapter_slots: Annotated[int | None, typer.Option(
            "--adapter-slots", help="LoRA slots on the device (default: max_adapters).")]
        = None,
        replicas: Annotated[int | None, typer.Option(
            "--replicas", help="Replicas on this host (default on cuda: GPUs // tp).")]
        = None,
        log_level: Annotated[str, typer.Option(
            "--log-level", help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
        compile_step: Annotated[bool | None, typer.Option(
            "--compile/--no-compile", help="Compile the decode step with torch.compile "
            "(default: SLUICE_COMPILE, else the compute config, else off).")] = None,
    ) -> None:
        """Serve one model: read its request topic, run it, write tokens to reply topics."""
        import uvloop

        from common.logs import setup_logging
        from common.settings import Settings
        from worker.identity import ReplicaTakenError
        from worker.supervision import StopWatchdog
        from worker.worker import STOP_DEADLINE_S, Worker, WorkerOptions

        setup_logging(log_level)
        settings = Settings.load(pool=pool, kafka_bootstrap=kafka_bootstrap,
                                 database_url=database_url, metrics_port=metrics_port)
        options = WorkerOptions(model=model, device=device, tp=tp, replica=replica,
                                instance_id=instance_id,
                                max_num_batched_tokens=max_batched_tokens,
                                adapter_slots=adapter_slots, compile=compile_step,
                                freeze_heap=True,
                                memory_budget_bytes=None if memory_budget_gib is None
                                else int(memory_budget_gib * 2**30))
        count = replicas if replicas is not None else _auto_replicas(settings, model, device, tp)
        if count > 1 and replica is None:  # several on one host: each its own GPUs, k*tp...
            options = dataclasses.replace(options, replica=0)
        watchdog = StopWatchdog(STOP_DEADLINE_S, lambda: 3 if worker.fatal is not None else 0)
        worker = Worker(settings, options, watchdog=watchdog)
        children = _spawn_other_replicas(count, options.replica or 0)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, worker.stop)
            loop.add_signal_handler(signal.SIGUSR1, _log_tasks)  # what is it waiting on?
            await worker.run()

        try:
            uvloop.run(main())
        except ReplicaTakenError as exc:
            raise fail(str(exc), 2) from None
        finally:
            # The interpreter's exit waits for the loop executor's threads: one stuck in
            # a call must not keep a stopped worker's process alive.
            watchdog.step = "exiting the process"
            watchdog.arm()
            _stop_children(children)
        if worker.fatal is not None:
            logging.getLogger("sluice").error("worker stopped: %s", worker.fatal)
            raise typer.Exit(3)
        logging.getLogger("sluice").info("worker stopped")


def _log_tasks() -> None:
    """Log every asyncio task's stack (SIGUSR1): where a worker that seems stuck waits."""
    import io

    out = io.StringIO()
    for task in asyncio.all_tasks():
        task.print_stack(limit=6, file=out)
    logging.getLogger("sluice").warning("asyncio tasks on SIGUSR1:\n%s", out.getvalue())


def _auto_replicas(settings: object, model: str, device: str, tp: int | None) -> int:
    """A GPU host runs GPUs // tp replicas of the model; a CPU host runs one."""
    if not device.startswith("cuda") or ":" in device:
        return 1
    import torch

    if tp is None:
        from sluice.client import Client

        with Client(settings) as client:  # type: ignore[arg-type]
            tp = client.models.show(model=model).compute_config.tp
    return max(1, torch.cuda.device_count() // tp)


def _spawn_other_replicas(count: int, first: int) -> list[subprocess.Popen[bytes]]:
    """Replicas first+1 .. first+count-1 as child processes (this one is `first`)."""
    children = []
    args = [a for a in sys.argv[1:] if a != "worker"]
    args = _without_option(_without_option(args, "--replica"), "--replicas")
    for k in range(first + 1, first + count):
        cmd = [sys.executable, "-m", "sluice", "worker", *args, "--replica", str(k),
               "--replicas", "1"]
        children.append(subprocess.Popen(cmd))
    return children


def _without_option(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(f"{name}="):
            out.append(arg)
    return out


def _stop_children(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
