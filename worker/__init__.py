"""worker: one model replica — the one place that assembles ingest, batcher,
gpu_runtime and results.

Entry point: `worker.worker.Worker(settings, WorkerOptions(model=...)).run()`
(`sluice worker`). `worker/worker.py` is the assembly, in the order a worker
starts and stops; its docstring maps the modules beside it (the model loaded,
delivery, handover of partitions, the request side, supervision, gauges,
identity, heartbeat and metrics).

It may import the rooms below it (ingest, batcher, results, gpu_runtime, common,
schemas), never `sluice` or the faces above: they take a worker, not the other
way round.
"""
