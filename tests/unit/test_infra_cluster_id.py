"""The KRaft cluster id sluice generates for `kafka-storage format`."""

from __future__ import annotations

import base64
import uuid

import pytest

from infra import kafka_broker


def test_cluster_id_never_begins_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0xF8 as the first byte encodes to a leading "-" in URL-safe base64; the storage
    # tool's parser would take such an id for an option (a CI run failed on exactly this).
    dash_first = uuid.UUID(bytes=bytes([0xF8]) + bytes(15))
    plain = uuid.UUID(bytes=bytes([0x10]) + bytes(15))
    assert base64.urlsafe_b64encode(dash_first.bytes).decode().startswith("-")
    draws = iter([dash_first, dash_first, plain])
    monkeypatch.setattr(kafka_broker.uuid, "uuid4", lambda: next(draws))

    cluster_id = kafka_broker.kraft_cluster_id()

    assert not cluster_id.startswith("-")
    assert base64.urlsafe_b64decode(cluster_id + "==") == plain.bytes


def test_cluster_ids_have_kafkas_shape() -> None:
    ids = {kafka_broker.kraft_cluster_id() for _ in range(2000)}
    assert len(ids) == 2000
    assert all(len(i) == 22 and not i.startswith("-") for i in ids)
