"""`sluice bench chaos` warms up until the answers settle: which round counts."""

from __future__ import annotations

from bench.chaos import _settled
from bench.chaos_report import ChaosConfig, ChaosReport, Sent


def _report(latencies: dict[str, float | None], outcome: str = "done") -> ChaosReport:
    report = ChaosReport(ChaosConfig(seed=7))
    for request_id, latency in latencies.items():
        report.sent[request_id] = Sent(request_id, 0.0, streamed=False, latency_s=latency,
                                       warmup=True, outcome=outcome)
    return report


def test_a_round_is_settled_when_nine_in_ten_answers_came_within_the_bound() -> None:
    fast = {f"chaos-7-w{i}": 0.2 for i in range(9)}
    assert _settled(_report({**fast, "chaos-7-w9": 5.0}), "chaos-7-w", 1.0)
    assert not _settled(_report({**fast, "chaos-7-w9": 5.0, "chaos-7-w10": 5.0}),
                        "chaos-7-w", 1.0)
    assert not _settled(_report({}), "chaos-7-w", 1.0)  # nothing answered yet


def test_each_round_is_judged_on_its_own_answers() -> None:
    """The first round's ids (`w17`) are not a later round's (`w2-17`), nor the other
    way round; unanswered ones count for nothing."""
    slow_first = {f"chaos-7-w{i}": 4.0 for i in range(10)}
    fast_second = {f"chaos-7-w2-{i}": 0.1 for i in range(10)}
    report = _report({**slow_first, **fast_second, "chaos-7-w2-10": None})
    assert not _settled(report, "chaos-7-w", 1.0)
    assert _settled(report, "chaos-7-w2-", 1.0)


def test_an_unanswered_request_counts_as_slow_and_an_error_not_at_all() -> None:
    fast = {f"chaos-7-w{i}": 0.2 for i in range(8)}
    report = _report(fast)
    for i, outcome in ((8, "client_timeout"), (9, "timeout"), (10, "send_failed")):
        report.sent[f"chaos-7-w{i}"] = Sent(f"chaos-7-w{i}", 0.0, streamed=False,
                                            outcome=outcome, warmup=True)
    assert not _settled(report, "chaos-7-w", 1.0)  # 3 of 11 never answered
    errors = _report({f"chaos-7-w{i}": 0.01 for i in range(8, 20)}, outcome="error")
    errors.sent.update(_report({**fast, "chaos-7-w99": 9.0}).sent)
    assert not _settled(errors, "chaos-7-w", 1.0)  # 1 slow of 9 done; errors not counted
