"""Session keys belong on their murmur2 partition (Kafka's Java default partitioner).

A key found on another partition means a producer partitions differently
(librdkafka's default is CRC32) and splits a session's turns across workers,
which then miss its KV cache. Records do not carry the producer's `client.id`,
so the audit counts such records and warns now and then with an example.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka.partitioner import murmur2
from aiokafka.structs import ConsumerRecord

log = logging.getLogger(__name__)

# A producer partitioning keys differently is warned about at most this often.
WARN_EVERY_S = 600.0


def murmur2_partition(key: bytes, num_partitions: int) -> int:
    """The partition Kafka's Java client (and aiokafka) picks for `key`."""
    return (murmur2(key) & 0x7FFFFFFF) % num_partitions


@dataclass(slots=True)
class PartitionAudit:
    on_misrouted: Callable[[int], None] | None = None  # a metric, by partition
    num_misrouted: int = 0
    _warned_at: float = -WARN_EVERY_S
    _since_warning: int = field(default=0)

    def check(self, record: ConsumerRecord, num_partitions: int | None) -> None:
        if record.key is None or not num_partitions:
            return
        expected = murmur2_partition(record.key, num_partitions)
        if expected == record.partition:
            return
        self.num_misrouted += 1
        self._since_warning += 1
        if self.on_misrouted is not None:
            self.on_misrouted(record.partition)
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning(
                "%d request(s) arrived on a partition other than their key's murmur2 partition "
                "(e.g. key %r on %s/%d, expected %d): a producer partitions differently, so a "
                "session's turns can reach different workers and miss their KV cache. "
                "The Java client's default partitioner (and aiokafka's, kafka-python's) is "
                "right; librdkafka-based producers (confluent-kafka, kcat, node-rdkafka, "
                "...) must set partitioner=murmur2_random; a custom partitioner must put "
                "a key on (murmur2(key) & 0x7fffffff) %% partitions", self._since_warning,
                record.key[:64], record.topic, record.partition, expected)
            self._warned_at = now
            self._since_warning = 0
