"""worker: one model replica — the one place that assembles ingest, batcher,
gpu_runtime and results (`worker.Worker`), with the request router and event
pump (`requests`), the deployment watcher, served adapters, metrics and the
heartbeat."""
