"""worker: one model replica — the one place that assembles ingest, batcher,
gpu_runtime and results.

Entry point: `worker.worker.Worker(settings, WorkerOptions(model=...)).run()`
(`sluice worker`). `worker.py` is the assembly, in the order a worker starts
and stops; each part it assembles has a module of its own:

    intake.py        prompts, the router and the consumer of the request topic
    requests.py      the router (verdicts in) and the event pump (events out)
    loaded_model.py  runtime + engine + adapters of one deployment; reloads
    delivery.py      at-least-once, or exactly-once with per-partition transactions
    handover.py      partitions revoked (within the rebalance timeout), the group left
    deployments.py   the control topic's deployment snapshots
    identity.py      the replica's group member id, held by a database lock
    supervision.py   every background task watched; shutdown steps; the stop watchdog
    gauges.py        queue, KV cache and lag gauges; the topic access check
    heartbeat.py, metrics.py, membership.py, served_adapters.py, options.py

It may import the rooms below it (ingest, batcher, results, gpu_runtime, common,
schemas), never `sluice` or the faces above: they take a worker, not the other
way round.
"""
