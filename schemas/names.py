"""Strict patterns for names that end up in topic names, SQL rows and log lines."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import StringConstraints

# Model keys become topic names (`sluice.requests.<model>`) and group ids.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
# Kafka's own rule for topic names (legal characters, at most 249 of them).
TOPIC_PATTERN = r"^[A-Za-z0-9._-]{1,249}$"
# Request and session ids: printable ASCII without spaces, bounded.
ID_PATTERN = r"^[\x21-\x7e]{1,256}$"
POOL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"

ModelName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
AdapterName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
TopicName = Annotated[str, StringConstraints(pattern=TOPIC_PATTERN)]
MessageId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
PoolName = Annotated[str, StringConstraints(pattern=POOL_PATTERN)]


class NameError_(ValueError):
    """A model, adapter, pool or topic name that breaks its pattern."""


def check_name(kind: str, value: str, pattern: str = NAME_PATTERN) -> str:
    if not isinstance(value, str) or re.fullmatch(pattern, value) is None:
        raise NameError_(
            f"invalid {kind} name {value!r}: use 1-64 letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return value


def is_valid_topic(name: str) -> bool:
    return re.fullmatch(TOPIC_PATTERN, name) is not None and name not in {".", ".."}
