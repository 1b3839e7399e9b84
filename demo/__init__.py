"""demo: `sluice demo`, the main job on the embedded default.

`run.run_demo` makes the tiny model with its adapters (taught a short chat on
first use: `modelfiles.tiny_train`), registers them, starts a worker in this
process and streams a multi-turn, multi-adapter workload through the real
broker, then prints the summary (requests, tokens/s, TTFT, cached prompt
tokens); with the bundled SmolLM2 installed, a real-model round too.

A face beside `gateway`: it may import the SDK (`sluice`), `worker`,
`modelfiles` and the rooms below; nothing imports it but the CLI.
"""
