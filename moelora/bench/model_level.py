"""Model-level benchmark: a whole transformers MoE model decoding with many adapters.

One process, one model of Qwen3-30B-A3B's shape (random weights; `--layers` defaults to the
full 48), the configurations users compare, alternated and warm at every timed shape:

- `hf_eager`: transformers' own generate, LoRA-free, its grouped_mm experts;
- `hf_static` (with --hf-static): the same with `cache_implementation="static"`, which
  transformers compiles on a GPU (minutes per shape: its first call is reported apart);
- `moelora_experts`: `handle.generate`, --adapters expert-only adapters mixed in the batch
  (row i uses adapter i % adapters);
- `moelora_attention`: the same count of adapters, --attention-adapters of them also with
  q/k/v/o LoRA.

Per (configuration, batch): time to first token (a generate of one new token: the prefill
plus one sample), prefill tokens/s, decode tokens/s ((new - 1) tokens per row over the time
a generate of --new tokens takes beyond the one-token call), peak memory, and the decode
step's memory floor: the bytes one decode step reads (every non-expert weight, the LM head,
the experts a batch of that size touches under uniform routing, the KV cache) over the copy
bandwidth measured in the same run, as decode tokens/s / floor tokens/s. Startup (attach,
adapter loads, the handle's warm-up where it has one) is reported once.

    python -m moelora.bench.model_level --layers 4 --batches 1,16,64 --json out/model.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..presets import PRESETS

CONFIGS = ("hf_eager", "hf_static", "moelora_experts", "moelora_attention")
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


def full_depth() -> int:
    return int(PRESETS["qwen3-30b-a3b"]["num_hidden_layers"])


def build_model(shape: Shape, device: str, dtype: torch.dtype):
    """The model with random non-zero weights (from_config may leave experts at zero)."""
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(shape.hf_config(), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return model.eval()


def write_adapter(root: Path, shape: Shape, rank: int, attention: bool, seed: int) -> Path:
    """One random adapter as PEFT writes it for Qwen3-MoE (bf16): target_parameters on the
    fused experts (A expert-major [E*r, in], B expert-minor [out, r*E]) and, when
    `attention`, target_modules q/k/v/o ([r, in] / [out, r]). Written directly: PEFT needs the
    whole model (twice, with its copy) to save one, and tests/test_model_level.py checks this
    layout loads to the same factors as PEFT's own save_pretrained on a small model."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * 0.02).to(torch.bfloat16)

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


def _timed(call: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    t = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - t


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=full_depth(), help="default: full depth")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--attention-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed passes per configuration")
    p.add_argument("--hf-static", action="store_true", help="add transformers' compiled path")
    p.add_argument("--configs", default=None, help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a tiny shape (CPU tests)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse(argv)
    from ..hf import attach

    rows: list[dict] = []

    def emit(**r) -> None:
        rows.append(r)
        print(json.dumps(r), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))

    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = Shape(a.layers)
    if a.small:
        shape = Shape(a.layers, vocab=256, hidden=64, inter=32, experts=8, top_k=2, heads=4,
                      kv_heads=2, head_dim=16)  # fmt: skip
    _stamp(emit, a, cuda)
    bandwidth = _bandwidth() if cuda else None
    t0 = time.perf_counter()
    model = build_model(shape, a.device, dtype)
    emit(kind="model", layers=shape.layers, build_s=round(time.perf_counter() - t0, 2),
         params_gib=round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 3))  # fmt: skip
    configs = _configs(a)
    handle, adapter_sets = None, {}
    if any(c.startswith("moelora") for c in configs):
        handle, adapter_sets = _attach(a, shape, model, attach, emit, sync)
    calls = {c: _call_for(c, model, handle, adapter_sets, a) for c in configs}
    gen = torch.Generator().manual_seed(1)
    for b in (int(b) for b in a.batches.split(",")):
        ids = torch.randint(1, shape.vocab, (b, a.prompt), generator=gen).to(a.device)
        floor = None
        if bandwidth:
            floor = b / (step_bytes(model, shape, b, a.prompt + a.new // 2) / bandwidth)
        _measure_batch(a, calls, ids, floor, emit, sync, cuda)
    return rows


def _measure_batch(a, calls: dict, ids, floor: float | None, emit, sync, cuda: bool) -> None:
    """Warm every configuration at this batch's shapes (graphs captured, compiles done), then
    time them alternately: a one-token generate (time to first token) and a --new one."""
    b = ids.shape[0]
    for c, call in calls.items():
        first = _timed(partial(call, ids, 1), sync)
        _timed(partial(call, ids, a.new), sync)
        if c == "hf_static":
            emit(kind="compile", config=c, batch=b, first_call_s=round(first, 1))
    times = {c: ([], []) for c in calls}
    for rep in range(a.repeats):
        for c in list(calls) if rep % 2 == 0 else list(calls)[::-1]:
            times[c][0].append(_timed(partial(calls[c], ids, 1), sync))
            times[c][1].append(_timed(partial(calls[c], ids, a.new), sync))
    for c, call in calls.items():
        peak = _peak(partial(call, ids, a.new)) if cuda else None
        ttft, total = min(times[c][0]), min(times[c][1])
        decode = b * (a.new - 1) / max(total - ttft, 1e-9)
        emit(kind="decode", config=c, batch=b, ttft_ms=round(ttft * 1e3, 2),
             prefill_tok_s=round(b * a.prompt / ttft, 1), decode_tok_s=round(decode, 1),
             floor_tok_s=None if floor is None else round(floor, 1),
             of_floor=None if floor is None else round(decode / floor, 3),
             peak_gib=None if peak is None else round(peak / 2**30, 3))  # fmt: skip


def _stamp(emit, a: argparse.Namespace, cuda: bool) -> None:
    import transformers as tf

    from .runner import commit

    emit(kind="versions", torch=torch.__version__, transformers=tf.__version__, commit=commit(),
         device=torch.cuda.get_device_name() if cuda else "cpu", date=time.strftime("%Y-%m-%d"),
         args=vars(a))  # fmt: skip


def _bandwidth() -> float:
    from .floors import measure_ceilings

    return measure_ceilings().bandwidth


def _configs(a: argparse.Namespace) -> list[str]:
    wanted = a.configs.split(",") if a.configs else [c for c in CONFIGS if c != "hf_static"]
    if a.hf_static and "hf_static" not in wanted:
        wanted.insert(1, "hf_static")
    unknown = sorted(set(wanted) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; expected some of {list(CONFIGS)}")
    return wanted


def _attach(a, shape: Shape, model, attach, emit, sync):
    """Write the adapters, attach, load them, warm up; report the startup."""
    root = Path(tempfile.mkdtemp(prefix="moelora-bench-"))
    dirs = {}
    for k in range(a.adapters):
        dirs[f"e{k}"] = write_adapter(root / f"e{k}", shape, a.rank, False, seed=10 + k)
    for k in range(a.attention_adapters):
        dirs[f"q{k}"] = write_adapter(root / f"q{k}", shape, a.rank, True, seed=100 + k)
    sync()
    t0 = time.perf_counter()
    handle = attach(model, num_slots=len(dirs), max_rank=a.rank)
    for name, path in dirs.items():
        handle.load_adapter(path, name=name)
    sync()
    loaded = time.perf_counter() - t0
    warm = getattr(handle, "warmup", None)
    warm_s = _timed(warm, sync) if callable(warm) else None
    emit(kind="startup", backend=handle.backend_name, attach_and_load_s=round(loaded, 2),
         warmup_s=None if warm_s is None else round(warm_s, 2), adapters=sorted(dirs))  # fmt: skip
    expert_only = [f"e{k}" for k in range(a.adapters)]
    attention = [f"q{k}" for k in range(a.attention_adapters)]
    # attention adapters first, interleaved: batch 1 runs one, every batch holds both kinds
    rest = expert_only[: a.adapters - len(attention)]
    mixed = [n for pair in zip(attention, rest) for n in pair] + attention[len(rest) :]
    mixed += rest[len(attention) :]
    return handle, {"moelora_experts": expert_only, "moelora_attention": mixed}


def _call_for(config: str, model, handle, sets: dict, a: argparse.Namespace):
    kw = dict(do_sample=False, pad_token_id=0)

    def hf(ids, new, **extra):
        if handle is not None:
            model.set_experts_implementation("grouped_mm")
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new,
                                  **kw, **extra)  # fmt: skip

    if config == "hf_eager":
        return hf
    if config == "hf_static":
        return lambda ids, new: hf(ids, new, cache_implementation="static")
    names = sets[config]

    def ml(ids, new):
        model.set_experts_implementation("moelora")
        rows = [names[i % len(names)] for i in range(ids.shape[0])]
        return handle.generate(ids, adapter_names=rows, max_new_tokens=new, min_new_tokens=new,
                               **kw)  # fmt: skip

    return ml


def _peak(call: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


if __name__ == "__main__":
    main()
