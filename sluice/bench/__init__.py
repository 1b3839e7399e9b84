"""The benchmark harness behind `sluice bench` (see benchmarks/README.md).

`scenarios.run_scenarios` runs each scenario beside its baseline; `harness`
holds figures, machine limits and the JSON document; `table` and `plot`
render it; `gpu` is the stand-alone GPU mode.
"""
