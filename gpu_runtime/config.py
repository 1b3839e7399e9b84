"""The model's architecture, read from a Hugging Face `config.json`.

A plain dataclass instead of transformers' config classes: the runtime must
not pay transformers' import time, and it needs only a dozen fields. Both the
transformers-4 (`rope_theta` + `rope_scaling`) and transformers-5
(`rope_parameters`) spellings of RoPE settings are understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpu_runtime.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that leaves sampling out gets: greedy, unless the model's
    generation_config.json samples (`do_sample`), then its temperature, top_p and
    top_k, with transformers' defaults (1.0, 1.0, 50) for those it leaves out."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_generation_config(cls, gen: dict[str, Any]) -> SamplingDefaults:
        if not gen.get("do_sample"):
            return cls()
        temperature = gen.get("temperature")
        top_p = gen.get("top_p")
        top_k = gen.get("top_k")
        return cls(temperature=float(1.0 if temperature is None else temperature),
                   top_p=float(1.0 if top_p is None else top_p),
                   top_k=int(50 if top_k is None else top_k))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    o_proj_bias: bool = False  # Llama's attention_bias covers o_proj too; Qwen2's does not
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a sequence
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    torch_dtype: str | None = None
    architecture: str = "LlamaForCausalLM"
    # Sliding-window attention (Mistral; Qwen2 with use_sliding_window): a token
    # attends to the last `sliding_window` positions (itself included) in the
    # layers flagged in `sliding_layers`, to the whole context in the others.
    # None / () when no layer uses a window.
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()

    def layer_window(self, layer_idx: int) -> int | None:
        """The attention window of one layer, None for full attention."""
        if self.sliding_window is None or not self.sliding_layers[layer_idx]:
            return None
        return self.sliding_window

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {raw['hidden_act']!r}; only silu")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            head_dim = raw.get("head_dim") or hidden // num_heads
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases and no `attention_bias` key.
                attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
                o_proj_bias=arch == "LlamaForCausalLM" and bool(raw.get("attention_bias")),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                rope=_rope_config(raw),
                eos_token_ids=_int_tuple(raw.get("eos_token_id")),
                torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
                architecture=arch,
                **_sliding_window(raw, int(raw["num_hidden_layers"])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad field: {exc}") from exc

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in {model_dir}")
        config = cls.from_dict(read_json(path, ModelLoadError))
        gen = _json_object(Path(model_dir) / "generation_config.json")
        # generation_config.json's eos ids (else config.json's), and the tokenizer's eos:
        # a chat model's end of turn may be in only one of them.
        eos = list(_int_tuple(gen.get("eos_token_id")) or config.eos_token_ids)
        tokenizer_eos = _tokenizer_eos_id(Path(model_dir))
        if tokenizer_eos is not None and tokenizer_eos not in eos:
            eos.append(tokenizer_eos)
        return replace(config, eos_token_ids=tuple(eos),
                       sampling_defaults=SamplingDefaults.from_generation_config(gen))


def context_limit(config: ModelConfig, max_model_len: int | None) -> int:
    """The longest context (prompt + output) served: `max_model_len`, by default the
    model's max_position_embeddings."""
    return max_model_len or config.max_position_embeddings


def _sliding_window(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """`sliding_window` and `sliding_layers` from HF's Mistral/Qwen2 conventions."""
    window = raw.get("sliding_window")
    if window is None:
        return {"sliding_window": None, "sliding_layers": ()}
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        sliding = tuple(kind == "sliding_attention" for kind in layer_types)
    elif "use_sliding_window" in raw:  # Qwen2 without layer_types
        # Layers from max_window_layers on slide (28: Qwen2Config's default).
        first = int(raw.get("max_window_layers", 28)) if raw["use_sliding_window"] else num_layers
        sliding = tuple(i >= first for i in range(num_layers))
    else:  # Mistral: a window given is a window used, by every layer
        sliding = (True,) * num_layers
    if not any(sliding):
        return {"sliding_window": None, "sliding_layers": ()}
    return {"sliding_window": int(window), "sliding_layers": sliding}


def read_json(path: Path, error: type[Exception]) -> Any:
    """The parsed JSON file; `error` if it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not valid JSON: {exc}") from exc


def _json_object(path: Path) -> dict[str, Any]:
    value = read_json(path, ModelLoadError) if path.is_file() else {}
    return value if isinstance(value, dict) else {}


def _tokenizer_eos_id(model_dir: Path) -> int | None:
    """The id of tokenizer_config.json's `eos_token` in tokenizer.json, if both exist."""
    eos = _json_object(model_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str) or not (model_dir / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(eos)


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How a `Runtime` runs a model: device, memory, KV cache, LoRA slots, ranks."""

    device: str = "cpu"
    dtype: str | None = None  # None: `loader.default_dtype` (the checkpoint's, mostly)
    kv_cache_len: int = 32768  # tokens
    block_size: int = 16
    quantization: str = "none"  # "none" | "fp8"
    max_model_len: int | None = None  # None: config.max_position_embeddings
    memory_budget_bytes: int | None = None  # None: free device memory / available RAM
    max_num_batched_tokens: int = 2048  # sizes the activation reserve only
    max_num_seqs: int = 256
    seed: int = 0  # of the shared generator used by unseeded requests
    max_adapters: int = 4  # LoRA slots on the device; 0 disables LoRA (no layer swap)
    max_lora_rank: int = 64  # slot capacity; adapters of higher rank are refused
    tp: int = 1  # ranks (processes, GPUs) this replica is split over; see ranks.py
    tp_timeout_s: float = 120.0  # a collective waiting longer on a hung rank: RankFailure
    # All-decode steps through torch.compile (compiled.py); call `Runtime.warm_up` to
    # compile before the first request instead of during it.
    compile: bool = False
    # CPU projections on oneDNN's prepacked weights (cpu_linear.py); off: `F.linear`.
    cpu_prepack: bool = True
    # CPU decode attention by the C kernel over the paged cache (cpu_attention.py); off:
    # the torch path (gather + SDPA).
    cpu_native_attention: bool = True
    # Prefill chunks by that kernel too: None times it against SDPA at load on the
    # model's heads and takes the faster (SDPA's flash attention runs on AMX tiles on
    # some CPUs); True or False decides.
    cpu_native_prefill: bool | None = None
    # Decode steps of up to 128 rows (20 in bfloat16 where oneDNN has AMX) by one C call
    # over all layers (cpu_decode.py), on a second copy of the layers' projection
    # weights; off: the torch path.
    cpu_native_decode: bool = True
