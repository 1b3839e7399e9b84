"""The bulk job's file handling: resume points and torn last lines."""

from __future__ import annotations

from pathlib import Path

from sluice.batch import answered_ids, drop_torn_tail, read_input


def test_torn_last_line_is_dropped_and_not_counted(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"custom_id": "a", "response": {}, "error": null}\n{"custom_id": "b", "re')
    assert answered_ids(out) == {"a"}
    drop_torn_tail(out)
    assert out.read_bytes().endswith(b"null}\n")
    assert answered_ids(out) == {"a"}


def test_input_problems_are_reported_per_line(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"custom_id": 1, "body": {"prompt": "x"}}\nnot json\n'
                    b'{"custom_id": 1, "body": {}}\n{"body": {}}\n\n')
    items, problems = read_input(src)
    assert items == [("1", {"prompt": "x"})]
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 3", "line 4"]
