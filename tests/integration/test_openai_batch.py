"""`sluice batch --format openai` through the CLI, on the real broker and a worker.

One OpenAI Batch API file mixing chat (string and list-form content), completions,
an adapter (`tiny:a0`), an adapter that does not exist (a 404 response), and lines
sluice refuses (`/v1/embeddings`, `gpt-4o`, `n: 3`): every output line parses with
the official `openai` package's types, the job exits 1 because of the failed lines,
and a re-run keeps the answered lines and retries only the others.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai.types
import openai.types.chat
import openai.types.shared
import orjson
import pytest

from tests.integration.pipeline_helpers import (
    drop_schema,
    settings_env,
    tiny_with_adapter,
    worker_process,
)

pytestmark = [pytest.mark.integration]

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
OPENING = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Say something."}]


def _request(custom_id: str, body: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


LINES = [
    _request("chat", {"model": "tiny", "messages": OPENING, "max_completion_tokens": 6,
                      "temperature": 0}),
    # No model (the job's), the same conversation as list-form text parts.
    _request("chat-parts", {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Say "},
                                     {"type": "text", "text": "something."}]}],
        "max_tokens": 6, "temperature": 0}),
    _request("text", {"model": "tiny", "prompt": "Once upon", "max_tokens": 5,
                      "temperature": 0}, url=TEXT),
    _request("adapter", {"model": "tiny:a0", "messages": OPENING, "max_tokens": 6}),
    _request("ghost-adapter", {"model": "tiny:ghost", "messages": OPENING, "max_tokens": 6}),
    _request("embeddings", {"model": "tiny", "input": "hello"}, url="/v1/embeddings"),
    _request("gpt-4o", {"model": "gpt-4o", "messages": OPENING}),
    _request("n-3", {"model": "tiny", "messages": OPENING, "n": 3}),
]
ANSWERED = {"chat", "chat-parts", "text", "adapter"}


def _outputs(out_path: Path) -> dict[str, dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    for raw in out_path.read_bytes().splitlines():
        line = orjson.loads(raw)
        assert line["custom_id"] not in by_id, f"two lines for {line['custom_id']}"
        by_id[line["custom_id"]] = line
    return by_id


def test_openai_batch_file_through_the_cli(settings, tiny_model, tmp_path: Path) -> None:
    client, key = tiny_with_adapter(settings, tiny_model, tmp_path / "adapters")
    client.close()
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    in_path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in LINES))
    env = {**settings_env(settings), "SLUICE_API_KEY": key, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "sluice", "batch", str(in_path), "--model", "tiny",
           "-o", str(out_path), "--format", "openai"]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True,
                              timeout=120)

    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            first = run()
            assert first.returncode == 1, first.stdout + first.stderr + worker.log()
            assert "4 done, 4 errors" in first.stdout, first.stdout
            assert "response.body.error" in first.stderr, first.stderr
            outputs = _outputs(out_path)
            assert set(outputs) == {line["custom_id"] for line in LINES}
            for line in outputs.values():
                assert list(line) == ["id", "custom_id", "response", "error"], line
                assert line["id"].startswith("batch_req_")

            chats = {}
            for custom_id in ("chat", "chat-parts", "adapter"):
                line = outputs[custom_id]
                assert line["error"] is None and line["response"]["status_code"] == 200, line
                assert line["response"]["request_id"].startswith("batch-")
                chats[custom_id] = openai.types.chat.ChatCompletion.model_validate(
                    line["response"]["body"])
                assert chats[custom_id].choices[0].message.content is not None
                assert chats[custom_id].usage is not None
                assert 1 <= chats[custom_id].usage.completion_tokens <= 6
            assert chats["chat"].model == chats["chat-parts"].model == "tiny"
            assert chats["adapter"].model == "tiny:a0"
            # List-form parts are the same prompt as the plain strings.
            assert chats["chat-parts"].usage.prompt_tokens == chats["chat"].usage.prompt_tokens
            text = openai.types.Completion.model_validate(outputs["text"]["response"]["body"])
            assert text.object == "text_completion" and text.choices[0].text is not None
            assert text.usage is not None and 1 <= text.usage.completion_tokens <= 5

            # Sent, and failed on the worker: OpenAI's convention, a response with the
            # status code and an error body.
            ghost = outputs["ghost-adapter"]
            assert ghost["error"] is None and ghost["response"]["status_code"] == 404
            error = openai.types.shared.ErrorObject.model_validate(
                ghost["response"]["body"]["error"])
            assert error.code == "unknown_adapter" and "ghost" in error.message

            # Never sent: no response, an error naming the reason.
            for custom_id, code, words in (("embeddings", "invalid_url", "/v1/embeddings"),
                                           ("gpt-4o", "mismatched_model", "gpt-4o"),
                                           ("n-3", "invalid_request", "`n`")):
                line = outputs[custom_id]
                assert line["response"] is None, line
                assert line["error"]["code"] == code and words in line["error"]["message"], line

            # A re-run keeps the answered lines as they are and retries the rest.
            second = run()
            assert second.returncode == 1, second.stdout + second.stderr + worker.log()
            assert "0 done, 4 errors, 4 skipped (already answered), 4 retried" \
                in second.stdout, second.stdout
            again = _outputs(out_path)
            assert set(again) == set(outputs)
            assert all(again[cid] == outputs[cid] for cid in ANSWERED)
            assert all(again[cid]["id"] != outputs[cid]["id"]
                       for cid in set(outputs) - ANSWERED)
            kept = run("--keep-errors")
            assert kept.returncode == 1, kept.stdout + kept.stderr
            assert "0 done, 0 errors, 4 skipped (already answered), 4 earlier errors kept" \
                in kept.stdout, kept.stdout
            assert _outputs(out_path) == again
    finally:
        asyncio.run(drop_schema(settings))
