"""The load benchmark's model and adapter directories (benchmarks/serve_load.py): a
config.json of Qwen3-30B-A3B's shape at any depth (or a tiny one for a CPU) with a
word-level tokenizer "w0 .. wV-1" and no weights (the server builds random ones,
`--load-format dummy`), and random PEFT adapters on the routed experts written in PEFT's own
file layout (a PEFT wrap of a 30 B model would copy it)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Qwen3-30B-A3B's attention and vocabulary (its public config.json) beside the preset's MoE keys
QWEN3_30B_REST = dict(
    vocab_size=151936, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # fmt: skip

# --tiny: the width of moelora.hf.toy's qwen3_moe, a vocabulary the word tokenizer spans fast
TINY = dict(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
            intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=512)  # fmt: skip


def model_config(layers: int, tiny: bool = False, positions: int | None = None) -> dict:
    """The config.json dict; `positions` raises max_position_embeddings where a longer
    context is asked for (the tiny model's default is 512)."""
    from moelora.presets import PRESETS

    preset = {k: v for k, v in PRESETS["qwen3-30b-a3b"].items() if k != "torch_dtype"}
    config = {**preset, **QWEN3_30B_REST, "num_hidden_layers": layers}
    if tiny:
        config |= {**TINY, "max_position_embeddings": 512}
    if positions:
        config["max_position_embeddings"] = max(config["max_position_embeddings"], positions)
    return config


def write_model_dir(root: Path, config: dict) -> None:
    """config.json and a word-level tokenizer "w0 .. wV-1" (no weights)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    root.mkdir(parents=True, exist_ok=True)
    transformers.AutoConfig.for_model(**config).save_pretrained(root)
    # no special token: every generated token decodes to one word (the clients count words)
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core)
    tok.save_pretrained(root)


def write_expert_adapter(root: Path, config: dict, rank: int, seed: int) -> None:
    """A PEFT target_parameters adapter on every layer's fused experts, in the file layout
    PEFT's save_pretrained writes (tests/test_serve_loadgen.py checks it against PEFT):
    gate_up (wrapped first: base_layer) A [E*r, H], B [2I, r*E]; down A [E*r, I], B [H, r*E]."""
    from safetensors.torch import save_file

    E, H = config["num_experts"], config["hidden_size"]
    I = config["moe_intermediate_size"]  # noqa: E741
    device = "cuda" if torch.cuda.is_available() else "cpu"  # 1.3 GB of randn: fast there
    gen = torch.Generator(device).manual_seed(seed)

    def factor(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        key = f"base_model.model.model.layers.{layer}.mlp.experts"
        for prefix, (a_in, b_out) in ((f"{key}.base_layer", (H, 2 * I)), (key, (I, H))):
            tensors[f"{prefix}.lora_A.weight"] = factor(E * rank, a_in)
            tensors[f"{prefix}.lora_B.weight"] = factor(b_out, rank * E)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, root / "adapter_model.safetensors")
    adapter_config = dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
        target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        bias="none", use_rslora=False, fan_in_fan_out=False, base_model_name_or_path=None,
    )  # fmt: skip
    (root / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
