"""A worker's list of the cluster's topics: a reply topic made a moment ago is found."""

from __future__ import annotations

import asyncio

from ingest.checks import RequestChecks
from ingest.verdicts import IngestOptions


def _checks(cluster: set[str], asked: list[int]) -> RequestChecks:
    options = IngestOptions(
        model="tiny", request_topic="sluice.requests.tiny", group_id="sluice.tiny",
        instance_id="w-0", default_reply_topic="sluice.results",
        internal_topics=frozenset({"sluice.requests.tiny"}),
        internal_prefixes=("sluice.requests.",), reply_topic_pattern=None, kafka_options={})

    async def topics() -> set[str]:
        asked.append(1)
        return set(cluster)

    return RequestChecks(options, checker=None, prompts=None, known_topics=topics)  # type: ignore[arg-type]


async def test_a_topic_created_just_after_a_refresh_is_not_refused() -> None:
    cluster, asked = {"sluice.results"}, []
    checks = _checks(cluster, asked)
    assert "does not exist" in (await checks._reply_topic_problem("nowhere") or "")
    cluster.add("gateway.new")  # a gateway starts right after that refresh
    assert await checks._reply_topic_problem("gateway.new") is None
    assert await checks._reply_topic_problem("sluice.results") is None  # known: no ask
    assert len(asked) == 2


async def test_misses_arriving_together_share_one_ask() -> None:
    cluster, asked = {"sluice.results"}, []
    checks = _checks(cluster, asked)
    await checks._reply_topic_problem("warm-up-miss")
    problems = await asyncio.gather(*(checks._reply_topic_problem(f"bogus-{i}")
                                      for i in range(50)))
    assert all("does not exist" in (p or "") for p in problems)
    assert len(asked) == 2  # the warm-up's, then one for all fifty
