"""Model-level benchmark: transformers generate on a Qwen3-MoE model with Qwen3-30B-A3B layer
shapes (random bf16 weights, --layers layers), HF's own experts (grouped_mm, no LoRA) beside
moelora serving --adapters PEFT adapters of --rank in one mixed batch, in one process.

For each batch size: whole-generate tokens/s (prompt --prompt tokens, --new new tokens,
greedy, min_new_tokens = max_new_tokens), prefill time (one forward of the prompt) and
decode tokens/s (the rest). Each configuration is warmed up at its own shapes; HF and
moelora alternate (same model: the experts implementation is switched between "grouped_mm"
and "moelora"). Before timing, every row of a mixed batch is checked against HF + PEFT
generating it alone (the first --check-new tokens, bf16: the count of equal tokens is
reported). Peak GPU memory of moelora's calls against the parameters + slot banks.
The HF + PEFT peer (../shared/peer/hf_peft_generate.py) runs in the same device call.

    python -m benchmarks.hf_generate --layers 4 --batches 1,16,64 --json out/hf_generate.json
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch


def add_run_args(p: argparse.ArgumentParser, layers: int) -> None:
    """The options a model-level generate benchmark shares (this one, fp8_generate.py)."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed passes per configuration")
    p.add_argument("--check-new", type=int, default=8, help="tokens checked per row")
    p.add_argument("--json", default=None)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, layers=4)
    return p.parse_args()


# Qwen3-30B-A3B's shape (all but the depth)
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8,
)  # fmt: skip


def build(layers: int, device: str = "cuda", seed: int = 0, **sizes):
    """A random bf16 Qwen3-MoE of Qwen3-30B-A3B's shape (`sizes` override it) on `device`."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Qwen3MoeConfig(
        **(QWEN3_30B_A3B | sizes), num_hidden_layers=layers, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
    )  # fmt: skip
    # built on the device itself: its random init runs there (a 48-layer model initialised
    # on the host and then copied took minutes)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # non-zero experts (from_config may leave them at zero)
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model


def write_adapters(model, root: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` random PEFT target_parameters adapters saved by PEFT (one wrap, N adapters)."""
    from peft import LoraConfig, get_peft_model

    lc = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=[], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    pm = get_peft_model(copy.deepcopy(model), lc, adapter_name="a0")
    for k in range(1, count):
        pm.add_adapter(f"a{k}", lc)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.02)
    pm.save_pretrained(str(root))  # one subdirectory per adapter name
    return {f"a{k}": root / f"a{k}" for k in range(count)}, pm


def timed_generate(call, ids, new: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    call(ids, new)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    a = parse()
    import transformers as tf

    from moelora.hf import attach

    rows = []

    def emit(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    emit(kind="versions", transformers=tf.__version__, torch=torch.__version__,
         device=torch.cuda.get_device_name())  # fmt: skip
    model = build(a.layers)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tmp = Path(tempfile.mkdtemp())
    dirs, peft_model = write_adapters(model, tmp, a.adapters, a.rank)
    handle = attach(model, num_slots=a.adapters, max_rank=a.rank)
    for name, path in dirs.items():
        handle.load_adapter(path, name=name)
    banks = sum(
        t.numel() * t.element_size()
        for bank in handle.registry.manager.snapshot().banks.values()
        for t in (bank.w13_a, bank.w13_b, bank.w2_a, bank.w2_b)
    )
    emit(kind="setup", backend=handle.backend_name, params_gib=round(params / 2**30, 3),
         banks_gib=round(banks / 2**30, 3))  # fmt: skip
    kw = dict(do_sample=False, pad_token_id=0)

    def hf(ids, new):
        model.set_experts_implementation("grouped_mm")
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, **kw)

    def ml(ids, new):
        model.set_experts_implementation("moelora")
        names = [f"a{i % a.adapters}" for i in range(ids.shape[0])]
        return handle.generate(
            ids, adapter_names=names, max_new_tokens=new, min_new_tokens=new, **kw
        )

    def prefill(which, ids):
        model.set_experts_implementation("grouped_mm" if which == "hf" else "moelora")
        names = [f"a{i % a.adapters}" for i in range(ids.shape[0])]
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            if which == "hf":
                model(input_ids=ids)
            else:
                handle(ids, adapter_names=names)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    # Correctness first: each row of a mixed batch against HF + PEFT generating it alone.
    gen = torch.Generator().manual_seed(1)
    check_ids = torch.randint(100, 151836, (a.adapters + 1, 32), generator=gen).cuda()
    names = [f"a{k}" for k in range(a.adapters)] + [None]
    out = handle.generate(check_ids, adapter_names=names, max_new_tokens=a.check_new, **kw)
    equal = []
    for row, name in enumerate(names):
        with torch.no_grad():
            if name is None:
                model.set_experts_implementation("grouped_mm")
                ref = model.generate(input_ids=check_ids[[row]], max_new_tokens=a.check_new, **kw)
                model.set_experts_implementation("moelora")
            else:
                peft_model.set_adapter(name)
                ref = peft_model.generate(
                    input_ids=check_ids[[row]], max_new_tokens=a.check_new, **kw
                )
        got, want = out[row, 32:], ref[0, 32:]
        same = int((got == want).cumprod(0).sum())
        equal.append(same)
    emit(kind="check", rows=len(names), equal_prefix_tokens=equal, of=a.check_new)
    del peft_model
    torch.cuda.empty_cache()

    batches = [int(b) for b in a.batches.split(",")]
    for b in batches:  # warm-up at every timed shape, both ways
        ids = torch.randint(100, 151836, (b, a.prompt), device="cuda")
        hf(ids, 8), ml(ids, 8), hf(ids, a.new), ml(ids, a.new)
        prefill("hf", ids), prefill("ml", ids)
    for b in batches:
        ids = torch.randint(100, 151836, (b, a.prompt), device="cuda")
        times = {"hf": [], "ml": [], "hf_pre": [], "ml_pre": []}
        for rep in range(a.repeats):
            order = ("hf", "ml") if rep % 2 == 0 else ("ml", "hf")
            for which in order:
                call = hf if which == "hf" else ml
                times[which].append(timed_generate(call, ids, a.new))
                times[which + "_pre"].append(prefill(which, ids))
        torch.cuda.reset_peak_memory_stats()
        ml(ids, a.new)
        peak_ml = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        hf(ids, a.new)
        peak_hf = torch.cuda.max_memory_allocated()
        for which in ("hf", "ml"):
            total, pre = min(times[which]), min(times[which + "_pre"])
            emit(
                kind="hf_base_grouped_mm" if which == "hf" else f"moelora_{a.adapters}_mixed",
                batch=b,
                tok_s=round(b * a.new / total, 1),
                prefill_ms=round(pre * 1e3, 2),
                prefill_tok_s=round(b * a.prompt / pre, 1),
                decode_tok_s=round(b * (a.new - 1) / max(total - pre, 1e-9), 1),
                peak_gib=round((peak_hf if which == "hf" else peak_ml) / 2**30, 3),
            )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
