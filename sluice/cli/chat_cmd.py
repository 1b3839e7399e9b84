"""`sluice chat --model KEY [--adapter A] [--session S]`: an interactive chat over Kafka."""

from __future__ import annotations

import os
import uuid
from typing import Annotated

import typer

from sluice.cli.common import friendly_errors


def register(app: typer.Typer) -> None:
    @app.command("chat")
    @friendly_errors
    def chat_cmd(
        model: Annotated[str, typer.Option("--model", help="The model's key.")],
        adapter: Annotated[str | None, typer.Option("--adapter")] = None,
        session: Annotated[str | None, typer.Option(
            "--session", help="Session id (default: a new one). Turns reuse its KV cache.")]
        = None,
        api_key: Annotated[str | None, typer.Option(
            "--api-key", help="API key (default: SLUICE_API_KEY).")] = None,
        max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
        temperature: Annotated[float, typer.Option("--temperature")] = 0.0,
        system: Annotated[str | None, typer.Option("--system", help="A system prompt.")]
        = None,
    ) -> None:
        """Chat with a model through Kafka; one line per turn, /exit or Ctrl-D to leave."""
        import asyncio

        import uvloop
        from rich.console import Console

        from schemas import DoneEvent, ErrorEvent, TimeoutEvent, TokenEvent
        from sluice.client import Client

        console = Console()
        key = api_key or os.environ.get("SLUICE_API_KEY")
        session_id = session or f"chat-{uuid.uuid4().hex[:12]}"
        messages: list[dict[str, str]] = []
        if system:
            messages.append({"role": "system", "content": system})

        async def turn(client: Client, text: str) -> None:
            messages.append({"role": "user", "content": text})
            reply = ""
            async for event in client.stream(
                model=model, adapter=adapter, session_id=session_id, api_key=key,
                messages=messages, max_tokens=max_tokens, temperature=temperature,
            ):
                if isinstance(event, TokenEvent):
                    console.print(event.text, end="", markup=False, highlight=False)
                elif isinstance(event, DoneEvent):
                    reply = event.text
                    console.print(f"\n[dim]({event.usage.completion_tokens} tokens, ttft "
                                  f"{event.timing.ttft_ms:.0f} ms, "
                                  f"{event.usage.cached_prompt_tokens} prompt tokens cached)[/]")
                elif isinstance(event, ErrorEvent):
                    console.print(f"\n[red]error ({event.code.value}): {event.message}[/]")
                    messages.pop()
                    return
                elif isinstance(event, TimeoutEvent):
                    console.print(f"\n[red]timed out after {event.waited_ms:.0f} ms[/]")
                    messages.pop()
                    return
            messages.append({"role": "assistant", "content": reply})

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

        uvloop.run(main())
