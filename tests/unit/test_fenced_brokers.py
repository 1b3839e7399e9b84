"""A client lets go of a broker the cluster's metadata no longer lists (fenced: a leader
cut off from the other brokers), so what it sent there is retried where the metadata
now says, instead of waiting for the cut to heal."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient, CoordinationType
from aiokafka.protocol.metadata import MetadataResponse_v1

from common.broker_loss import forget_coordinators_on, let_go_of_fenced_brokers


class Connection:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _metadata(*node_ids: int) -> MetadataResponse_v1:
    return MetadataResponse_v1(brokers=[(n, "127.0.0.1", 9000 + n, None) for n in node_ids],
                               controller_id=node_ids[0], topics=[])


async def test_connections_to_a_broker_left_out_of_the_metadata_are_closed() -> None:
    client = AIOKafkaClient(bootstrap_servers="127.0.0.1:9001")
    client.cluster.update_metadata(_metadata(1, 2, 3))
    let_go_of_fenced_brokers(client, "a test client")
    conns = {(n, group): Connection() for n in (1, 2, 3) for group in (0, 1)}
    client._conns.update(conns)

    client.cluster.update_metadata(_metadata(1, 2, 3))  # nothing changed
    assert not any(conn.closed for conn in conns.values())

    client.cluster.update_metadata(_metadata(1, 3))  # node 2 fenced
    assert {key for key, conn in conns.items() if conn.closed} == {(2, 0), (2, 1)}

    # The fenced broker's own stale answer lists every broker: nothing more is closed,
    # and node 2 leaving again later is noticed again.
    conns[(2, 0)] = client._conns[(2, 0)] = Connection()
    client.cluster.update_metadata(_metadata(1, 2, 3))
    assert not conns[(2, 0)].closed and not conns[(1, 0)].closed
    client.cluster.update_metadata(_metadata(1, 3))
    assert conns[(2, 0)].closed and not conns[(3, 1)].closed


async def test_a_producer_forgets_its_coordinators_on_a_fenced_broker() -> None:
    """Pins the aiokafka internals `forget_coordinators_on` uses (its sender's
    coordinators by kind): an aiokafka that moved them fails here, not in a metadata
    listener under a fault."""
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:9001", enable_idempotence=True)
    coordinators = producer._sender._coordinators
    coordinators.update({CoordinationType.TRANSACTION: 2, CoordinationType.GROUP: 3})
    forget_coordinators_on(producer)(2)
    assert coordinators == {CoordinationType.GROUP: 3}
    let_go_of_fenced_brokers(producer.client, "a test producer",
                             also=forget_coordinators_on(producer))
    producer.client.cluster.update_metadata(_metadata(1, 2, 3))
    producer.client.cluster.update_metadata(_metadata(1, 2))  # node 3 fenced
    assert coordinators == {}
