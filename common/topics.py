"""Topics are created by sluice itself, never by broker auto-creation.

Shared topics at first start (`sluice.control` compacted), a model's request
topic when the model is registered (with `LogAppendTime`, so a request's TTFT
clock starts when the broker took it). Replicated min(3, brokers) times, with
`min.insync.replicas=2` once that is 3.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
    for_code,
)
from aiokafka.protocol.metadata import MetadataRequest

from common.errors import InvalidConfigError
from common.settings import Settings
from common.timeouts import dependency_call

# Kafka protocol error codes of a CreateTopics answer.
TOPIC_ALREADY_EXISTS = 36
INVALID_REPLICATION_FACTOR = 38


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    configs: dict[str, str]


def shared_topics(settings: Settings) -> list[TopicSpec]:
    return [
        TopicSpec(settings.topic("results"), 8, {}),
        TopicSpec(settings.topic("timeouts"), 4, {}),
        TopicSpec(settings.topic("deadletter"), 4, {}),
        TopicSpec(settings.topic("control"), 1, {"cleanup.policy": "compact"}),
    ]


def request_topic(settings: Settings, model: str, partitions: int | None = None) -> TopicSpec:
    return TopicSpec(
        settings.requests_topic(model),
        partitions or settings.request_partitions,
        # Room for oversized requests to reach the worker and get a clear error
        # (the worker's own limit is schemas.MAX_MESSAGE_BYTES) instead of a
        # broker-side refusal the producer may not report well.
        {"message.timestamp.type": "LogAppendTime", "max.message.bytes": str(16 * 1024 * 1024)},
    )


def internal_topic_names(settings: Settings) -> set[str]:
    return {spec.name for spec in shared_topics(settings)} - {settings.topic("results")}


def is_internal_topic(settings: Settings, topic: str) -> bool:
    """sluice's own request, control, timeout and dead-letter topics."""
    return topic in internal_topic_names(settings) or topic.startswith(
        settings.topic("requests.")
    )


class TopicAdmin:
    """A thin, timeout-bounded wrapper of aiokafka's admin client."""

    def __init__(self, settings: Settings):
        self._settings = settings
        self._admin = AIOKafkaAdminClient(
            **settings.kafka_options(),
            request_timeout_ms=int(settings.client.timeout_secs * 1000),
        )

    async def __aenter__(self) -> TopicAdmin:
        from common.kafka_connect import connect

        await connect(self._admin.start(), self._settings, "the admin API")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._admin.close()

    async def replication_factor(self) -> int:
        """`SLUICE_TOPIC_REPLICATION_FACTOR`, else min(3, brokers in the cluster): 1 on
        the local broker, 3 on a production cluster."""
        if self._settings.topic_replication_factor is not None:
            return self._settings.topic_replication_factor
        cluster = await dependency_call("describing the Kafka cluster",
                                        self._admin.describe_cluster(),
                                        self._settings.client.timeout_secs)
        return max(1, min(3, len(cluster["brokers"])))

    async def ensure(self, specs: list[TopicSpec]) -> list[str]:
        """Create the topics that do not exist yet; returns the names created."""
        existing = set(await self.list_topics())
        missing = [s for s in specs if s.name not in existing]
        created = []
        replicas = await self.replication_factor() if missing else 1
        for spec in missing:
            configs = dict(spec.configs)
            if replicas >= 3:
                # An acknowledged write (acks=all) then survives the loss of any one
                # broker, and one broker down does not stop writes.
                configs.setdefault("min.insync.replicas", "2")
            topic = NewTopic(spec.name, spec.partitions, replicas, topic_configs=configs)
            response = await dependency_call(
                f"creating topic {spec.name}", self._admin.create_topics([topic]),
                self._settings.client.timeout_secs,
            )
            # aiokafka reports a refused creation in the response, not by raising.
            for name, code, message in response.topic_errors:
                if code == TOPIC_ALREADY_EXISTS:
                    continue
                if code != 0:
                    raise InvalidConfigError(
                        f"creating topic {name} ({spec.partitions} partitions, replication "
                        f"factor {replicas}) failed: {message or f'error code {code}'}"
                        + (" — set SLUICE_TOPIC_REPLICATION_FACTOR"
                           if code == INVALID_REPLICATION_FACTOR else "")
                    )
                created.append(name)
        return created

    async def delete(self, names: list[str]) -> None:
        """Delete topics; one that does not exist is not an error."""
        existing = set(await self.list_topics())
        doomed = [name for name in names if name in existing]
        if doomed:
            await dependency_call(f"deleting topics {', '.join(doomed)}",
                                  self._admin.delete_topics(doomed),
                                  self._settings.client.timeout_secs)

    async def list_topics(self) -> list[str]:
        return await dependency_call(
            "listing Kafka topics", self._admin.list_topics(), self._settings.client.timeout_secs
        )


async def partitions_of(client_of: object, topic: str) -> set[int]:
    """The partitions of `topic`, asked of the broker now (empty if it does not exist).

    `client_of`: an aiokafka consumer or producer (their own `partitions_for_topic`
    only knows topics they already follow). Asks for this one topic, never creating
    it, so a principal that may not see it gets TopicAuthorizationFailedError rather
    than an empty answer (Kafka answers so for a topic that does not exist either,
    when the principal may not DESCRIBE it); KafkaError when no broker answers. Each
    known broker is asked in turn (random order) until one answers: asking one alone
    failed a client's send while that broker was killed (`sluice bench chaos`).
    """
    client = getattr(client_of, "client", None) or client_of._client  # type: ignore[attr-defined]
    nodes = [broker.nodeId for broker in client.cluster.brokers()]
    if not nodes:
        await client.bootstrap()
        nodes = [broker.nodeId for broker in client.cluster.brokers()]
    random.shuffle(nodes)
    request = MetadataRequest(topics=[topic], allow_auto_topic_creation=False)
    failure: KafkaError = KafkaConnectionError("no broker of the cluster is known")
    for node in nodes:
        try:
            response = await client.send(node, request)
            break
        except KafkaError as exc:  # that broker away (killed, restarting): ask the next
            failure = exc
    else:
        raise failure
    for error_code, name, *_, partitions in response.topics:
        if name != topic:
            continue
        error = for_code(error_code)
        if error is TopicAuthorizationFailedError:
            raise TopicAuthorizationFailedError(topic)
        if error is UnknownTopicOrPartitionError:
            return set()
        if error_code != 0 and not partitions:
            raise error(topic)
        return {partition[1] for partition in partitions}
    return set()


async def committed_of(client_of: object, group_id: str, topic: str,
                       partition: int) -> tuple[int, str] | None:
    """(offset, metadata) that consumer group `group_id` committed for a partition, asked
    of its coordinator through an aiokafka client already connected (a producer's, a
    consumer's); None when it committed nothing. Raises what the broker answers (e.g.
    GroupAuthorizationFailedError for a principal that may not describe the group)."""
    return (await committed_and_coordinator(client_of, group_id, topic, partition))[0]


async def committed_and_coordinator(client_of: object, group_id: str, topic: str,
                                    partition: int) -> tuple[tuple[int, str] | None, int]:
    """`committed_of`, and the node id of the coordinator that answered."""
    from aiokafka.protocol.commit import OffsetFetchRequest

    client = getattr(client_of, "client", None) or client_of._client  # type: ignore[attr-defined]
    node = await client.coordinator_lookup(0, group_id)  # 0: a consumer group
    response = await client.send(node, OffsetFetchRequest(group_id, [(topic, [partition])]))
    top_error = getattr(response, "error_code", 0)
    if top_error:
        raise for_code(top_error)(f"committed offsets of group {group_id}")
    for name, partitions in response.topics:
        for number, offset, metadata, error_code in partitions:
            if name == topic and number == partition:
                if error_code:
                    raise for_code(error_code)(f"committed offset of {topic}/{partition}")
                return (None if offset < 0 else (offset, metadata or "")), node
    return None, node
