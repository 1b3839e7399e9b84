"""The network's faults in a networked chaos run: nftables rules between the hosts of
`infra.netns` (brokers, PostgreSQL and each worker in a namespace of its own), each
healed when its time is up — or when the run stops early.

- `worker_cut_from_brokers`: a worker reaches no broker (packets dropped both ways) but
  still reaches PostgreSQL, past its session timeout: its partitions move, and when it
  is healed it is a zombie of the network, as a paused worker is of the scheduler.
- `worker_cut_from_database`: a worker reaches no PostgreSQL (permission checks, the
  replica lock, cancels kept there) while Kafka works.
- `leader_isolated_from_brokers`: the broker leading most request partitions is cut
  from the other two brokers — its followers and the rest of the controller quorum —
  and stays reachable by every client. This is the case where a client can be wrong:
  the leader still answers, cannot get an acks=all write in sync (min.insync.replicas
  is 2), and is fenced by the controller after `broker.session.timeout.ms` (6 s) while
  it still believes it leads; clients must follow the metadata of the other brokers.
  Cutting it from clients too would be a plain broker loss, which `broker_kill` covers.
  It lasts as long as a killed broker stays down (`broker_down_s`).
- `lossy_links`: one worker's or broker's link loses a share of its packets, each way,
  and is capped in bandwidth. The cap is the closest to a slow link this kernel allows:
  it has no netem qdisc, so no added delay (see `infra.netns`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from bench.chaos_cluster import (
    BROKER_HOSTS,
    POSTGRES_HOST,
    Cluster,
    request_leaders,
    worker_host,
)
from bench.chaos_report import Fault
from infra.netns import Network


async def _cut_for(net: Network, host: str, peers: list[str], seconds: float) -> None:
    """Cut `host` from each of `peers` for `seconds`, then heal (also when cancelled)."""
    try:
        await asyncio.to_thread(lambda: [net.cut(host, peer) for peer in peers])
        await asyncio.sleep(seconds)
    finally:
        await asyncio.to_thread(lambda: [net.heal(host, peer) for peer in peers])


async def _worker_cut_from_brokers(c: Cluster, fault: Fault) -> None:
    replica = c.rng.randrange(c.cfg.workers)
    fault.target = f"worker {replica}"
    await _cut_for(_net(c), worker_host(replica), list(BROKER_HOSTS),
                   c.rng.uniform(*c.cfg.partition_s))


async def _worker_cut_from_database(c: Cluster, fault: Fault) -> None:
    replica = c.rng.randrange(c.cfg.workers)
    fault.target = f"worker {replica}"
    await _cut_for(_net(c), worker_host(replica), [POSTGRES_HOST],
                   c.rng.uniform(*c.cfg.db_cut_s))


async def _leader_isolated_from_brokers(c: Cluster, fault: Fault) -> None:
    leaders = await request_leaders(c.settings)
    node = leaders.most_common(1)[0][0] if leaders else 1
    host = BROKER_HOSTS[node - 1]
    fault.target = f"broker {node} (leads {leaders.get(node, 0)} of {sum(leaders.values())})"
    await _cut_for(_net(c), host, [b for b in BROKER_HOSTS if b != host],
                   c.rng.uniform(*c.cfg.broker_down_s))


async def _lossy_links(c: Cluster, fault: Fault) -> None:
    net = _net(c)
    host = c.rng.choice([*(worker_host(r) for r in range(c.cfg.workers)), *BROKER_HOSTS])
    loss = c.rng.randint(*c.cfg.loss_percent)
    rate = c.rng.randint(*c.cfg.bandwidth_bytes_per_s)
    fault.target = f"{host} ({loss} % loss, {rate // 1000} kB/s each way)"
    try:
        await asyncio.to_thread(lambda: (net.lossy(host, loss), net.bandwidth(host, rate)))
        await asyncio.sleep(c.rng.uniform(*c.cfg.lossy_s))
    finally:
        await asyncio.to_thread(lambda: (net.lossy(host, 0), net.bandwidth(host, None)))


def _net(c: Cluster) -> Network:
    if c.net is None:
        raise RuntimeError("a network fault needs a networked run")
    return c.net


NETWORK_STRIKES: dict[str, Callable[[Cluster, Fault], Awaitable[None]]] = {
    "worker_cut_from_brokers": _worker_cut_from_brokers,
    "worker_cut_from_database": _worker_cut_from_database,
    "leader_isolated_from_brokers": _leader_isolated_from_brokers,
    "lossy_links": _lossy_links,
}
