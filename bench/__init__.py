"""bench: the benchmark harness behind `sluice bench` (tables and method in
benchmarks/README.md).

Entry points: `scenarios.run_scenarios` runs each scenario beside its baseline;
`harness` holds figures, machine limits and the JSON document; `table` and `plot`
render it; `chaos.run_chaos` is the seeded fault run (`--networked`: on
`infra.netns` hosts, with network faults); `gpu` the stand-alone GPU
mode; `cpu_kernels`, `fp8_load_memory`, `tp_check` run as `python -m bench.NAME`.

It may import the faces below it (the SDK `sluice`, `gateway`), `worker`,
`modelfiles` and every lower room; only the CLI imports it.
"""
