"""`sluice demo`, the README's main job, runs end to end on the real broker and database."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("broker", ["plaintext", "sasl_ssl"])
def test_demo_runs_end_to_end(broker, request, unique_name, tmp_path) -> None:
    """The demo's workload, on the plaintext broker and over SASL_SSL (SCRAM) to the
    secure one with PostgreSQL over TLS — the settings `sluice infra env` prints."""
    endpoints = request.getfixturevalue("endpoints" if broker == "plaintext"
                                        else "secure_endpoints")
    env = {
        **os.environ,
        **endpoints.env(),
        "SLUICE_DB_SCHEMA": unique_name,
        "SLUICE_TOPIC_PREFIX": unique_name,
        "COLUMNS": "120",
    }
    if broker == "plaintext":
        # A first run's caches: the native kernels are built and the bundled SmolLM2
        # imported from its GGUF file in the demo itself, as on a fresh machine.
        env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, "-m", "sluice", "demo", "--workdir", str(tmp_path),
         "--conversations", "4", "--bulk", "8",
         # the real model's chat once (on the plaintext broker), its import included
         "--real-model" if broker == "plaintext" else "--no-real-model"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The output is the demo's own: the logs (Kafka client retries too) are in its file,
    # and no library draws a progress bar (transformers' and the GGUF reader's tqdm did).
    assert '"level":' not in output, result.stderr[-3000:]
    assert not re.search(r"\d+%\||it/s\]|s/it\]", output), output[-3000:]
    assert (tmp_path / "demo.log").is_file()
    if broker == "plaintext":
        assert any((tmp_path / "cache" / "sluice" / "models").glob("SmolLM2-*/model.safetensors"))
    rows = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    assert rows["chat requests done"] == "12"  # 4 conversations x 3 turns
    assert rows["bulk requests done"] == "8"
    assert rows["timeouts / errors"] == "0 / 0"
    cached, _, prompt = rows["cached prompt tokens"].partition(" of ")
    assert 0 < int(cached) < int(prompt)  # later turns reuse earlier turns' KV
    # The taught model answers in its own words, and each adapter in its voice —
    # the four conversations ran through one worker, batched together.
    from modelfiles.tiny_train import BASE_ANSWERS, QUESTIONS, VOICES

    answers = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 4 and cells[0].isdigit():
            answers[(cells[1], cells[2])] = cells[3]
    expected = {(who, question): said[i]
                for who, said in {"base": BASE_ANSWERS, **VOICES}.items()
                for i, question in enumerate(QUESTIONS)}
    assert answers == expected
    if broker == "plaintext":  # SmolLM2-135M-Instruct, its template, ended by its eos
        real = result.stdout[result.stdout.index("a real model:"):]
        assert "Paris" in real and "Berlin" in real, real
        assert real.count("finish stop") == 2, real
