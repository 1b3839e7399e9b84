"""What a chaos run is given (`ChaosConfig`) and what it records (`ChaosReport`: the
requests sent, the faults, the violations), with the names all its parts share."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.harness import latency_figures

MODEL = "chaos"
TERMINAL = {"done", "error", "timeout"}
SESSION_TIMEOUT_S = 10.0  # the workers' consumer session (ingest.consumer)
Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    seed: int = 1
    requests: int = 3000
    rate_per_s: float = 10.0
    sessions: int = 200
    workers: int = 3
    partitions: int = 6
    faults: int = 12
    delivery: str = "exactly_once"
    kinds: tuple[str, ...] = ("worker_kill", "worker_pause", "broker_kill", "postgres_restart")
    stream_share: float = 0.3
    cancel_share: float = 0.03
    max_tokens: tuple[int, int] = (8, 40)
    pause_s: tuple[float, float] = (SESSION_TIMEOUT_S + 4, SESSION_TIMEOUT_S + 10)
    broker_down_s: tuple[float, float] = (8.0, 15.0)
    postgres_down_s: tuple[float, float] = (2.0, 6.0)
    restart_after_s: tuple[float, float] = (1.0, 3.0)
    request_timeout_s: float = 300.0


@dataclass(slots=True)
class Fault:
    kind: str
    at_s: float  # since the load began
    target: str
    ended_s: float | None = None


@dataclass(slots=True)
class Sent:
    request_id: str
    at_s: float
    streamed: bool
    cancelled: bool = False
    outcome: str = "pending"  # done, error, timeout, send_failed, client_timeout
    latency_s: float | None = None


@dataclass(slots=True)
class ChaosReport:
    config: ChaosConfig
    faults: list[Fault] = field(default_factory=list)
    sent: dict[str, Sent] = field(default_factory=dict)
    terminal_histogram: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    offset_samples: int = 0
    stale_offset_reads: list[str] = field(default_factory=list)
    num_records: int = 0
    calm_latency_s: list[float] = field(default_factory=list)
    fault_latency_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        outcomes = Counter(s.outcome for s in self.sent.values())
        def ms(values: list[float]) -> dict[str, Any]:
            return latency_figures([v * 1000 for v in values])
        return {
            "seed": self.config.seed, "delivery": self.config.delivery,
            "requests": len(self.sent), "outcomes": dict(outcomes),
            "terminal_events_per_request": {str(k): v for k, v in
                                            sorted(self.terminal_histogram.items())},
            "violations": len(self.violations), "first_violations": self.violations[:20],
            "faults": [dataclasses.asdict(f) for f in self.faults],
            "offset_samples": self.offset_samples,
            "stale_offset_reads": self.stale_offset_reads,
            "reply_records": self.num_records,
            "end_to_end_calm": ms(self.calm_latency_s),
            "end_to_end_during_faults": ms(self.fault_latency_s),
            "wall_s": round(self.wall_s, 1),
        }
