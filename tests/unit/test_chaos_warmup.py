"""`sluice bench chaos` warms up until the answers settle: how a round is judged."""

from __future__ import annotations

from bench.chaos import _settled
from bench.chaos_report import Sent


def _round(latencies: list[float | None], outcome: str = "done") -> list[Sent]:
    return [Sent(f"chaos-7-w{i}", 0.0, streamed=False, outcome=outcome, latency_s=latency,
                 warmup=True) for i, latency in enumerate(latencies)]


def test_a_round_is_settled_when_nine_in_ten_answers_came_within_the_bound() -> None:
    assert _settled(_round([0.2] * 9 + [5.0]), 1.0)
    assert not _settled(_round([0.2] * 9 + [5.0, 5.0]), 1.0)
    assert not _settled([], 1.0)  # nothing sent


def test_an_unanswered_request_counts_as_slow_and_an_error_not_at_all() -> None:
    unanswered = [Sent(f"chaos-7-w{i}", 0.0, streamed=False, outcome=outcome, warmup=True)
                  for i, outcome in ((8, "client_timeout"), (9, "timeout"),
                                     (10, "send_failed"))]
    assert not _settled(_round([0.2] * 8) + unanswered, 1.0)  # 3 of 11 never answered
    # 1 slow of 9 done: not settled, however many fast error answers came with them.
    assert not _settled(_round([0.01] * 12, outcome="error") + _round([0.2] * 8 + [9.0]),
                        1.0)
