"""`sluice demo`: the whole product on one machine, in one command.

Starts the local Kafka broker and PostgreSQL when none is configured, makes
a tiny model (and LoRA adapters, where the runtime supports them), registers
it, creates an API key, runs a worker in this process, then drives a
multi-turn, multi-adapter chat workload plus a small bulk job through Kafka,
streaming one conversation to the terminal, and prints a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from schemas import DoneEvent, TimeoutEvent, TokenEvent
from sluice.batch import run_batch
from sluice.client import Client
from sluice.errors import ConflictError
from sluice.settings import Settings
from sluice.worker import Worker, WorkerOptions

MODEL = "demo"
QUESTIONS = [
    "Where does the river begin?",
    "What lives along its banks?",
    "How does the water reach the sea?",
]


@dataclass(slots=True)
class DemoStats:
    done: list[DoneEvent] = field(default_factory=list)
    timeouts: int = 0
    errors: int = 0
    started: float = field(default_factory=time.monotonic)


def _make_model(workdir: Path, num_adapters: int) -> tuple[Path, list[Path]]:
    from gpu_runtime.tiny import make_tiny_model

    model_dir = workdir / "tiny"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir)
    adapters: list[Path] = []
    try:
        from gpu_runtime.tiny import make_tiny_adapters  # the multi-LoRA issue adds this
    except ImportError:
        return model_dir, adapters
    adapter_root = workdir / "adapters"
    if not adapter_root.exists():
        make_tiny_adapters(model_dir, adapter_root, num_adapters)
    adapters = sorted(p for p in adapter_root.iterdir() if p.is_dir())[:num_adapters]
    return model_dir, adapters


def _register(client: Client, model_dir: Path, adapters: list[Path]) -> tuple[str, list[str]]:
    with contextlib.suppress(ConflictError):  # registered by an earlier run: keep it
        client.models.register(model=MODEL, path=str(model_dir),
                               compute_config={"kv_cache_len": 16384})
    existing = {a.name for a in client.adapters.list(model=MODEL)}
    names = []
    for path in adapters:
        if path.name not in existing:
            client.adapters.register(model=MODEL, name=path.name, path=str(path))
        names.append(path.name)
    key = client.keys.create(tenant="demo")
    client.keys.grant(key, model=MODEL)
    for name in names:
        client.keys.grant(key, model=MODEL, adapter=name)
    return key, names


async def _conversation(client: Client, key: str, index: int, adapter: str | None,
                        stats: DemoStats, console: Console, show: bool) -> None:
    messages = [{"role": "system", "content": "You answer in one short line."}]
    session = f"demo-{os.getpid()}-{index}"
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        if show:
            console.print(f"[bold cyan]user[/] ({adapter or 'base'}): {question}")
            console.print("[bold green]assistant[/]: ", end="")
        async for event in client.stream(model=MODEL, api_key=key, adapter=adapter,
                                         session_id=session, messages=messages, max_tokens=24,
                                         temperature=0.0, request_id=f"{session}-t{turn}"):
            if isinstance(event, TokenEvent) and show:
                console.print(event.text, end="", highlight=False, markup=False)
            elif isinstance(event, DoneEvent):
                stats.done.append(event)
                messages.append({"role": "assistant", "content": event.text})
                if show:
                    cached = event.usage.cached_prompt_tokens
                    console.print(f"  [dim](ttft {event.timing.ttft_ms:.0f} ms, "
                                  f"{cached}/{event.usage.prompt_tokens} prompt tokens "
                                  "cached)[/]")
            elif isinstance(event, TimeoutEvent):
                stats.timeouts += 1
                return
            elif event.type == "error":
                stats.errors += 1
                if show:
                    console.print(f"[red]error: {event.message}[/]")  # type: ignore[union-attr]
                return


async def _bulk(client: Client, key: str, workdir: Path, count: int) -> tuple[int, int]:
    in_path, out_path = workdir / "bulk-in.jsonl", workdir / f"bulk-out-{os.getpid()}.jsonl"
    lines = [{"custom_id": f"bulk-{i}", "body": {"prompt": f"Note {i}: the river",
                                                  "max_tokens": 16}} for i in range(count)]
    in_path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
    summary = await run_batch(client, in_path, out_path, model=MODEL, api_key=key,
                              concurrency=16)
    return summary.num_done, summary.num_completion_tokens


def _summary(stats: DemoStats, bulk: tuple[int, int], seconds: float) -> Table:
    ttfts = sorted(d.timing.ttft_ms for d in stats.done)
    tokens = sum(d.usage.completion_tokens for d in stats.done) + bulk[1]
    cached = sum(d.usage.cached_prompt_tokens for d in stats.done)
    prompt = sum(d.usage.prompt_tokens for d in stats.done)

    def pct(q: float) -> str:
        if not ttfts:
            return "-"
        return f"{ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]:.0f} ms"

    table = Table(title="sluice demo", show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("chat requests done", str(len(stats.done)))
    table.add_row("bulk requests done", str(bulk[0]))
    table.add_row("tokens generated", str(tokens))
    table.add_row("tokens/s (wall clock)", f"{tokens / seconds:.1f}")
    table.add_row("chat TTFT p50", pct(0.5))
    table.add_row("chat TTFT p99", pct(0.99))
    table.add_row("chat TTFT mean", f"{statistics.fmean(ttfts):.0f} ms" if ttfts else "-")
    table.add_row("cached prompt tokens", f"{cached} of {prompt}")
    table.add_row("timeouts / errors", f"{stats.timeouts} / {stats.errors}")
    return table


async def run_demo(settings: Settings, workdir: Path, *, conversations: int = 4,
                   bulk_requests: int = 32, console: Console | None = None) -> DemoStats:
    console = console or Console()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, adapter_dirs = await asyncio.to_thread(_make_model, workdir, 3)
    client = Client(settings)
    key, adapters = await asyncio.to_thread(_register, client, model_dir, adapter_dirs)
    console.print(f"model [bold]{MODEL}[/] at {model_dir}; adapters: {adapters or 'none'}")
    worker = Worker(settings, WorkerOptions(model=MODEL, instance_id=f"demo-{os.getpid()}"))
    worker_task = asyncio.create_task(worker.run())
    try:
        # One request first, so the summary measures serving, not start-up.
        await client.complete(model=MODEL, api_key=key, prompt="warm up", max_tokens=1)
        stats = DemoStats()
        choices: list[str | None] = [None, *adapters]
        chats = [
            _conversation(client, key, i, choices[i % len(choices)], stats, console, i == 0)
            for i in range(conversations)
        ]
        results = await asyncio.gather(
            asyncio.gather(*chats), _bulk(client, key, workdir, bulk_requests)
        )
        bulk = results[1]
        seconds = time.monotonic() - stats.started
        console.print(_summary(stats, bulk, seconds))
    finally:
        worker.stop()
        await worker_task
        await client.aclose()
    return stats
