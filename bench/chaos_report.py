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
PROCESS_KINDS = ("worker_kill", "worker_pause", "broker_kill", "postgres_restart")
# Faults of the network between hosts: only in a networked run (`bench.chaos_network`).
NETWORK_KINDS = ("worker_cut_from_brokers", "leader_isolated_from_brokers",
                 "worker_cut_from_database", "lossy_links")
# A networked run's kinds, a network's and a process's in turn: the faults are dealt
# in this order (then shuffled), so that even a short run gets both.
ALL_KINDS = tuple(kind for pair in zip(NETWORK_KINDS, PROCESS_KINDS, strict=True)
                  for kind in pair)


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
    kinds: tuple[str, ...] = PROCESS_KINDS
    # Brokers, PostgreSQL and each worker on a host (network namespace) of their own.
    networked: bool = False
    stream_share: float = 0.3
    cancel_share: float = 0.03
    max_tokens: tuple[int, int] = (8, 40)
    pause_s: tuple[float, float] = (SESSION_TIMEOUT_S + 4, SESSION_TIMEOUT_S + 10)
    broker_down_s: tuple[float, float] = (8.0, 15.0)
    postgres_down_s: tuple[float, float] = (2.0, 6.0)
    restart_after_s: tuple[float, float] = (1.0, 3.0)
    # A worker cut from the brokers past its session timeout: a zombie, as when paused.
    # The leader isolated from the other brokers as long as a killed broker is down.
    partition_s: tuple[float, float] = (SESSION_TIMEOUT_S + 4, SESSION_TIMEOUT_S + 10)
    db_cut_s: tuple[float, float] = (5.0, 15.0)
    lossy_s: tuple[float, float] = (10.0, 20.0)
    loss_percent: tuple[int, int] = (5, 15)
    bandwidth_bytes_per_s: tuple[int, int] = (32_000, 256_000)
    request_timeout_s: float = 300.0
    # Before the measured load: requests at the same rate for this long, all answered
    # before the clock starts (fresh brokers JIT-compile and fresh workers build their
    # kernels' plans; a deployment that serves is warm). Checked like the others.
    warmup_s: float = 20.0
    # ... and on past it, WARMUP_ROUND_S at a time, until a round's answers are settled
    # (p90 at most `warm_p90_s`), no round begun past `warmup_max_s`: a fresh cluster of
    # three brokers on two cores commits transactions 5-10x slower in its first minute
    # (measured with exactly-once: commits 1-2.4 s, then 0.15-0.35 s) — its JVMs still
    # compiling, not the calm a deployment serves in. The warm-up's length is reported.
    warmup_max_s: float = 120.0
    warm_p90_s: float = 1.0
    # The measured load's first seconds (at most a fifth of it) are free of faults: the
    # calm latencies.
    calm_s: float = 30.0
    # After a fault heals, the next waits this long (and for capacity to be back).
    settle_s: float = 5.0

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - {*PROCESS_KINDS, *NETWORK_KINDS}
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}")
        if not self.networked and set(self.kinds) & set(NETWORK_KINDS):
            raise ValueError(f"{sorted(set(self.kinds) & set(NETWORK_KINDS))} need a "
                             "networked run (networked=True, `--networked`)")


@dataclass(slots=True)
class Fault:
    kind: str
    at_s: float  # since the load began
    target: str
    ended_s: float | None = None
    # Seconds from the fault's end until the group had every worker serving every
    # request partition again, each partition with a leader (None: not measured).
    capacity_back_s: float | None = None


@dataclass(slots=True)
class Sent:
    request_id: str
    at_s: float
    streamed: bool
    cancelled: bool = False
    outcome: str = "pending"  # done, error, timeout, send_failed, client_timeout
    latency_s: float | None = None
    warmup: bool = False  # sent before the measured load: checked, not timed


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
    reply_reads: int = 0  # reads of the reply topic `check_replies` needed
    calm_latency_s: list[float] = field(default_factory=list)
    # Lines of the workers' logs that say they stop, and exits the nemesis did not cause.
    worker_stops: list[str] = field(default_factory=list)
    worker_exits: list[str] = field(default_factory=list)
    fault_latency_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    warmup_s: float = 0.0  # how long the warm-up went on

    def summary(self) -> dict[str, Any]:
        measured = [s for s in self.sent.values() if not s.warmup]
        outcomes = Counter(s.outcome for s in measured)
        capacity = [f.capacity_back_s for f in self.faults if f.capacity_back_s is not None]
        def ms(values: list[float]) -> dict[str, Any]:
            return latency_figures([v * 1000 for v in values])
        return {
            "seed": self.config.seed, "delivery": self.config.delivery,
            "requests": len(measured), "outcomes": dict(outcomes),
            "warmup_requests": len(self.sent) - len(measured),
            "warmup_s": round(self.warmup_s, 1),
            "timeout_share": round(outcomes.get("timeout", 0) / max(1, len(measured)), 4),
            "terminal_events_per_request": {str(k): v for k, v in
                                            sorted(self.terminal_histogram.items())},
            "violations": len(self.violations), "first_violations": self.violations[:20],
            "networked": self.config.networked,
            "faults_by_kind": dict(sorted(Counter(f.kind for f in self.faults).items())),
            "faults": [dataclasses.asdict(f) for f in self.faults],
            "worker_stops": self.worker_stops, "worker_exits": self.worker_exits,
            "offset_samples": self.offset_samples,
            "stale_offset_reads": self.stale_offset_reads,
            "reply_records": self.num_records, "reply_reads": self.reply_reads,
            "end_to_end_calm": ms(self.calm_latency_s),
            "end_to_end_during_faults": ms(self.fault_latency_s),
            "capacity_back_s": {"max": max(capacity, default=None),
                                "unmeasured": len(self.faults) - len(capacity)},
            "wall_s": round(self.wall_s, 1),
        }
