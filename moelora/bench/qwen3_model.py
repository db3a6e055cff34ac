"""The model the model-level benchmarks run (model_level.py, benchmarks/fp8_generate.py): a Qwen3-MoE of
Qwen3-30B-A3B's shape (its published sizes, any depth; SMALL for CPU tests) with random
experts, the adapters PEFT would write for it, and the bytes one decode step reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..presets import PRESETS

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Shape:
    """The decoder of the benchmark model (Qwen3-30B-A3B's published sizes)."""

    layers: int
    vocab: int = 151936
    hidden: int = 2048
    inter: int = 768  # per expert
    experts: int = 128
    top_k: int = 8
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128

    def hf_config(self):
        import transformers as tf

        return tf.Qwen3MoeConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=3 * self.hidden,
            moe_intermediate_size=self.inter, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, num_experts=self.experts, num_experts_per_tok=self.top_k,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, bos_token_id=None,
            tie_word_embeddings=False,
        )  # fmt: skip


SMALL = dict(vocab=256, hidden=64, inter=32, experts=8, top_k=2, heads=4, kv_heads=2, head_dim=16)


def full_depth() -> int:
    return int(PRESETS["qwen3-30b-a3b"]["num_hidden_layers"])


def build_model(shape: Shape, device: str, dtype: torch.dtype, seed: int = 0):
    """The model, built on `device` itself (a 48-layer model initialised on the host and then
    copied took minutes), its experts random and non-zero (from_config may leave them at
    zero), the rest as transformers initialises it."""
    import transformers as tf

    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(shape.hf_config(), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model.eval()


def build(layers: int, device: str = "cuda", seed: int = 0, **sizes):
    """build_model in bf16 with `sizes` (Shape's fields) overriding Qwen3-30B-A3B's."""
    return build_model(Shape(layers, **sizes), device, torch.bfloat16, seed)


def write_adapter(
    root: Path, shape: Shape, rank: int, attention: bool, seed: int, device: str = "cpu"
) -> Path:
    """One random adapter as PEFT writes it for Qwen3-MoE (bf16): target_parameters on the
    fused experts (A expert-major [E*r, in], B expert-minor [out, r*E]) and, when
    `attention`, target_modules q/k/v/o ([r, in] / [out, r]). Written directly: PEFT needs the
    whole model (twice, with its copy) to save one, and tests/test_model_level.py checks this
    layout loads to the same factors as PEFT's own save_pretrained on a small model. The
    numbers are drawn on `device` (a 48-layer adapter is 830 M of them: about 5 s a core on
    the host, milliseconds on a GPU)."""
    from safetensors.torch import save_file

    gen = torch.Generator(device).manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        x = torch.randn(*size, generator=gen, device=device) * 0.02
        return x.to(torch.bfloat16).cpu()

    e, h, i, r = shape.experts, shape.hidden, shape.inter, rank
    q_out, kv_out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    sizes = {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out)}
    sizes["o_proj"] = (q_out, h)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape.layers):
        pre = f"base_model.model.model.layers.{layer}"
        tensors[f"{pre}.mlp.experts.base_layer.lora_A.weight"] = rand(e * r, h)
        tensors[f"{pre}.mlp.experts.base_layer.lora_B.weight"] = rand(2 * i, r * e)
        tensors[f"{pre}.mlp.experts.lora_A.weight"] = rand(e * r, i)
        tensors[f"{pre}.mlp.experts.lora_B.weight"] = rand(h, r * e)
        for name in ATTENTION if attention else ():
            fan_in, fan_out = sizes[name]
            tensors[f"{pre}.self_attn.{name}.lora_A.weight"] = rand(r, fan_in)
            tensors[f"{pre}.self_attn.{name}.lora_B.weight"] = rand(fan_out, r)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "use_rslora": False,
        "target_modules": list(ATTENTION) if attention else [],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "rank_pattern": {}, "alpha_pattern": {}, "lora_dropout": 0.0, "bias": "none",
        "peft_version": "0.21.0",
    }  # fmt: skip
    (root / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return root


def step_bytes(model, shape: Shape, batch: int, context: int) -> float:
    """Bytes one decode step of `batch` rows reads: every weight but the routed experts, the
    experts a batch touches under uniform routing (E * (1 - (1 - K/E)^B) per layer), and the
    KV cache of `context` tokens per row."""
    expert = 0
    other = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".mlp.experts." in name:
            expert += size
        else:
            other += size
    touched = 1 - (1 - shape.top_k / shape.experts) ** batch
    kv = 2 * shape.layers * batch * context * shape.kv_heads * shape.head_dim * 2
    return other + expert * touched + kv
