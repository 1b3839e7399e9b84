"""Letting go of a broker the cluster has fenced.

A leader cut off from the other brokers but not from its clients still answers them:
it takes an acks=all write and holds it until the request times out (it cannot get its
followers in sync, and Kafka has no leader lease), long after the controller fenced it
and another broker leads. Clients learn of the new leader from the metadata of the
other brokers, which leave a fenced broker out of their broker list; aiokafka updates
its routing then but keeps waiting on the requests it sent the old leader, and what
waits behind them (`sluice bench chaos --networked`, the isolated leader: answers
waited until the cut healed, 12-25 s).

`let_go_of_fenced_brokers` closes a client's connections to a broker as soon as the
metadata no longer lists it: its requests in flight fail as a lost connection does, and
the client retries them (idempotent writes: nothing twice) where the metadata now says.
A stale answer of the isolated broker itself still lists every broker, so it never
closes anything. A producer's transaction coordinator on that broker is forgotten too:
aiokafka retries a coordinator request against the same broker for as long as it fails
to connect, and looks the coordinator up anew only when a broker answers that it is
not (or no longer) the coordinator — which the fenced broker, cut off, never says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def let_go_of_fenced_brokers(client: Any, what: str,
                             also: Callable[[int], None] | None = None) -> None:
    """On each metadata update of aiokafka's `client`, close its connections to brokers
    the update no longer lists, and call `also` with each such broker's id. `what`
    names the client in the log line."""
    cluster = client.cluster
    known: set[int] = {broker.nodeId for broker in cluster.brokers()}

    def on_update(updated: Any) -> None:
        try:
            let_go(updated)
        except Exception:  # inside aiokafka's metadata update: never break that
            log.exception("%s: letting go of a fenced broker failed", what)

    def let_go(updated: Any) -> None:
        nonlocal known
        listed = {broker.nodeId for broker in updated.brokers()}
        gone, known = known - listed, listed
        for node_id in gone:
            if also is not None:
                also(node_id)
            conns = [(key, conn) for key, conn in list(client._conns.items())
                     if key[0] == node_id]
            if not conns:
                continue
            log.warning("%s: broker %s is no longer in the cluster's metadata (fenced or "
                        "gone); closing its connections so that what waits on it is "
                        "sent to the brokers that lead now", what, node_id)
            for _key, conn in conns:
                conn.close()  # aiokafka opens a new one if the broker is asked again

    cluster.add_listener(on_update)


def forget_coordinators_on(producer: Any) -> Callable[[int], None]:
    """For `let_go_of_fenced_brokers(..., also=)`: the coordinators a producer knows on a
    broker (its transaction coordinator, say) are looked up again before their next
    request."""
    def forget(node_id: int) -> None:
        coordinators = producer._sender._coordinators
        for kind, coordinator in list(coordinators.items()):
            if coordinator == node_id:
                coordinators.pop(kind, None)
    return forget
