"""`sluice worker --model KEY [--pool P] [--device cpu|cuda] [--tp N]`."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Annotated

import typer

from sluice.cli.common import friendly_errors


def register(app: typer.Typer) -> None:
    @app.command("worker")
    @friendly_errors
    def worker_cmd(
        model: Annotated[str, typer.Option("--model", help="The model's key.")],
        pool: Annotated[str | None, typer.Option("--pool", help="Compute pool (SLUICE_POOL).")]
        = None,
        device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
        tp: Annotated[int | None, typer.Option("--tp", help="Ranks per replica.")] = None,
        replica: Annotated[int, typer.Option("--replica", help="Replica index on this host.")]
        = 0,
        instance_id: Annotated[str | None, typer.Option(
            "--instance-id", help="Static group member id (default pool-host-replica).")] = None,
        max_batched_tokens: Annotated[int, typer.Option("--max-batched-tokens")] = 512,
        memory_budget_gib: Annotated[float | None, typer.Option(
            "--memory-budget-gib", help="Device memory the model may use (default: free).")]
        = None,
        kafka_bootstrap: Annotated[str | None, typer.Option("--kafka-bootstrap")] = None,
        database_url: Annotated[str | None, typer.Option("--database-url")] = None,
        metrics_port: Annotated[int | None, typer.Option(
            "--metrics-port", help="Prometheus port (SLUICE_METRICS_PORT; 0 = any free).")]
        = None,
        adapter_slots: Annotated[int | None, typer.Option(
            "--adapter-slots", help="LoRA slots on the device (default: max_adapters).")]
        = None,
        log_level: Annotated[str, typer.Option("--log-level")] = "INFO",
    ) -> None:
        """Serve one model: read its request topic, run it, write tokens to reply topics."""
        import uvloop

        from sluice.logs import setup_logging
        from sluice.settings import Settings
        from sluice.worker import Worker, WorkerOptions

        setup_logging(log_level)
        settings = Settings.load(pool=pool, kafka_bootstrap=kafka_bootstrap,
                                 database_url=database_url, metrics_port=metrics_port)
        options = WorkerOptions(model=model, device=device, tp=tp, replica=replica,
                                instance_id=instance_id,
                                max_num_batched_tokens=max_batched_tokens,
                                adapter_slots=adapter_slots,
                                memory_budget_bytes=None if memory_budget_gib is None
                                else int(memory_budget_gib * 2**30))
        worker = Worker(settings, options)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, worker.stop)
            await worker.run()

        uvloop.run(main())
        logging.getLogger("sluice").info("worker stopped")
