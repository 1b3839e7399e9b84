"""Fixtures of the end-to-end tests: a tiny model and per-test settings."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.settings import Settings
from gpu_runtime.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def request_partitions() -> int:
    """Override in a module to change the partitions of the model's request topic."""
    return 2


@pytest.fixture
def settings(endpoints, unique_name: str, request_partitions: int) -> Settings:
    """Settings of one test: its own topic prefix and database schema."""
    return Settings(kafka_bootstrap=endpoints.kafka_bootstrap,
                    database_url=endpoints.database_url, db_schema=unique_name,
                    topic_prefix=unique_name, request_partitions=request_partitions,
                    kafka=endpoints.kafka_settings())


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real Jaeger (`infra.jaeger`: OTLP over HTTP in, the query API out) on free
    loopback ports, once per run. Skipped only where its binary cannot be built; in CI
    (which builds it in `make setup`) that is a failure."""
    from infra import jaeger as local_jaeger
    from infra.common import InfraError

    try:
        local_jaeger.ensure_binary()
    except InfraError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"jaeger could not be built: {exc}")
    running = local_jaeger.start(tmp_path_factory.mktemp("jaeger"))
    try:
        yield running
    finally:
        running.stop()
