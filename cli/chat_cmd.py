"""`sluice chat --model KEY [--adapter A] [--session S]`: an interactive chat over Kafka."""

from __future__ import annotations

import os
import uuid
from typing import Annotated

import typer

from cli.common import friendly_errors


def register(app: typer.Typer) -> None:
    @app.command("chat")
    @friendly_errors
    def chat_cmd(
        model: Annotated[str, typer.Option("--model", help="The model's key.")],
        adapter: Annotated[str | None, typer.Option(
            "--adapter", help="A LoRA adapter of the model (default: the base model).")] = None,
        session: Annotated[str | None, typer.Option(
            "--session", help="Session id (default: a new one). Turns reuse its KV cache.")]
        = None,
        api_key: Annotated[str | None, typer.Option(
            "--api-key", help="API key (default: SLUICE_API_KEY).")] = None,
        max_tokens: Annotated[int, typer.Option(
            "--max-tokens", help="Most tokens per answer.")] = 128,
        temperature: Annotated[float | None, typer.Option(
            "--temperature", help="Sampling temperature (0: greedy; default: the "
            "model's generation_config.json, else greedy).")] = None,
        timeout: Annotated[float | None, typer.Option(
            "--timeout", min=0.001, help="Seconds to wait for each answer (default: "
            "SLUICE_CLIENT__REQUEST_TIMEOUT_SECS).")] = None,
        system: Annotated[str | None, typer.Option("--system", help="A system prompt.")]
        = None,
    ) -> None:
        """Chat with a model through Kafka; one line per turn, /exit or Ctrl-D to leave;
        Ctrl-C during an answer cancels it."""
        import asyncio

        import uvloop
        from rich.console import Console

        from schemas import DoneEvent, ErrorEvent, TimeoutEvent, TokenEvent
        from sluice.client import Client
        from sluice.errors import RequestTimeoutError

        console = Console()
        key = api_key or os.environ.get("SLUICE_API_KEY")
        session_id = session or f"chat-{uuid.uuid4().hex[:12]}"
        messages: list[dict[str, str]] = []
        if system:
            messages.append({"role": "system", "content": system})

        async def turn(client: Client, text: str) -> None:
            """One answer; Ctrl-C while it streams cancels it (the SDK sends a cancel
            record, so the worker stops generating) and the chat goes on."""
            import signal

            answer = asyncio.ensure_future(answer_turn(client, text))
            loop = asyncio.get_running_loop()
            previous = signal.getsignal(signal.SIGINT)
            loop.add_signal_handler(signal.SIGINT, answer.cancel)
            try:
                await answer
            except asyncio.CancelledError:
                if not answer.cancelled():
                    raise
                console.print("\n[dim](cancelled)[/]")
                messages.pop()
            finally:
                loop.remove_signal_handler(signal.SIGINT)
                signal.signal(signal.SIGINT, previous)

        async def answer_turn(client: Client, text: str) -> None:
            messages.append({"role": "user", "content": text})
            reply = ""
            try:
                async for event in client.stream(
                    model=model, adapter=adapter, session_id=session_id, api_key=key,
                    messages=messages, max_tokens=max_tokens, timeout=timeout,
                    **({"temperature": temperature} if temperature is not None else {}),
                ):
                    if not show(event):
                        messages.pop()
                        return
                    if isinstance(event, DoneEvent):
                        reply = event.text
            except RequestTimeoutError as exc:
                console.print(f"\n[red]{exc}[/]", highlight=False)
                messages.pop()
                return
            messages.append({"role": "assistant", "content": reply})

        def show(event: object) -> bool:
            """Print one event; False when the turn failed."""
            if isinstance(event, TokenEvent):
                console.print(event.text, end="", markup=False, highlight=False)
            elif isinstance(event, DoneEvent):
                console.print(f"\n[dim]({event.usage.completion_tokens} tokens, ttft "
                              f"{event.timing.ttft_ms:.0f} ms, "
                              f"{event.usage.cached_prompt_tokens} prompt tokens cached)[/]")
            elif isinstance(event, ErrorEvent):
                console.print(f"\n[red]error ({event.code.value}): {event.message}[/]",
                              highlight=False)
                return False
            elif isinstance(event, TimeoutEvent):
                console.print(f"\n[red]timed out after {event.waited_ms:.0f} ms[/]")
                return False
            return True

        async def main() -> None:
            client = Client()
            console.print(f"[dim]session {session_id}; /exit to leave[/]")
            try:
                while True:
                    try:
                        text = await asyncio.to_thread(console.input, "[bold cyan]you>[/] ")
                    except EOFError:
                        break
                    if text.strip() in ("/exit", "/quit"):
                        break
                    if text.strip():
                        await turn(client, text)
            finally:
                await client.aclose()

        try:
            uvloop.run(main())
        except KeyboardInterrupt:
            console.print("\n[dim]bye[/]")
            raise typer.Exit(130) from None
