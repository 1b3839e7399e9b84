"""Write a small random-weight Llama model in Hugging Face format.

Used by `sluice models make-tiny`, the tests and the demo. Pure torch +
safetensors + tokenizers: no transformers needed. The tokenizer is a
byte-level BPE trained on a short built-in text, so any string encodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_CORPUS = """\
Requests arrive on Kafka topics, are batched by deadline and run on the model.
The quick brown fox jumps over the lazy dog. Tokens stream back to the reply topic.
A session keeps its KV cache, so the second turn of a chat computes only new tokens.
Hello world! How are you today? I am fine, thank you. What is the weather like?
Adapters share one base model; the batcher mixes them in one step.
0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' " @ # $ % & _
"""

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")


@dataclass(frozen=True, slots=True)
class TinySpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 384  # target BPE size; the trained size may be smaller
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seed: int = 0


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def random_llama_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 weights, N(0, 0.02), norms around 1."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    state = {"model.embed_tokens.weight": rand(config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }  # fmt: skip
        for name, shape in shapes.items():
            state[p + name + ".weight"] = rand(*shape)
        state[p + "input_layernorm.weight"] = 1 + rand(h)
        state[p + "post_attention_layernorm.weight"] = 1 + rand(h)
    state["model.norm.weight"] = 1 + rand(h)
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = rand(config["vocab_size"], h)
    return state


def make_tiny_model(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json."""
    spec = spec or TinySpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(spec.vocab_size)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": "float32",
    }
    save_file(random_llama_weights(config, spec.seed), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    return out


# (rank, lora_alpha, use_rslora, targets) of adapter i, cycled: varied ranks and targets.
_ADAPTER_SPECS = (
    (8, 16.0, False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (4, 8.0, False, ("q_proj", "v_proj")),
    (16, 8.0, True, ("o_proj", "gate_proj", "down_proj")),
    (2, 4.0, False, ("k_proj", "up_proj")),
)


def make_tiny_adapters(model_dir: str | Path, out_root: str | Path, n: int) -> list[Path]:
    """Write `n` PEFT LoRA adapters for the model in `model_dir` as out_root/adapter-{i}.

    Non-zero, distinct random weights (seeded by i); ranks, alphas and target
    modules vary (adapter 2, 6, ... uses rslora). Written with safetensors:
    loadable by PEFT's `PeftModel.from_pretrained` and by the runtime.
    """
    from gpu_runtime.config import ModelConfig
    from gpu_runtime.lora_format import CONFIG_FILE, WEIGHTS_FILE, projection_shape

    config = ModelConfig.from_dir(model_dir)
    paths = []
    for i in range(n):
        rank, alpha, rslora, targets = _ADAPTER_SPECS[i % len(_ADAPTER_SPECS)]
        gen = torch.Generator().manual_seed(1000 + i)
        state = {}
        for layer in range(config.num_layers):
            for proj in targets:
                group = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{group}.{proj}"
                out_f, in_f = projection_shape(config, proj)
                a = torch.randn(rank, in_f, generator=gen) / in_f**0.5
                state[f"{prefix}.lora_A.weight"] = a
                state[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
        out = Path(out_root) / f"adapter-{i}"
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        adapter_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "use_rslora": rslora, "target_modules": list(targets), "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "base_model_name_or_path": str(Path(model_dir).resolve()),
        }  # fmt: skip
        (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
        paths.append(out)
    return paths
