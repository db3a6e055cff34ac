"""Where a small-batch decode step's host time goes with moelora's experts (GPU only):
a 2-layer Qwen3-MoE with Qwen3-30B-A3B layer shapes, 8 adapters (one PEFT file under 8
names), batch 1; per-step time with transformers' grouped_mm and with moelora, then the
profiler's top CPU ops of a moelora generate.
    python -m benchmarks hf_profile
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split(":")[0]).parse_args()
    from moelora.hf import attach, toy

    model = toy.build_model(
        "qwen3_moe", seed=0, dtype=torch.bfloat16, device="cuda", hidden_size=2048,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=2,
        head_dim=128, num_attention_heads=32, num_key_value_heads=4, vocab_size=4096,
        intermediate_size=6144,
    )  # fmt: skip
    tmp = Path(tempfile.mkdtemp())
    spec = toy.demo_adapters(model)["fused-r8"]
    toy.write_peft_adapter(model, tmp / "a", seed=1, **{**spec, "r": 16, "lora_alpha": 32})
    handle = attach(model, num_slots=8, max_rank=16)
    for k in range(8):
        handle.load_adapter(tmp / "a", name=f"a{k}")
    ids = torch.randint(1, 4000, (1, 128), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0)

    def run(impl: str, new: int):
        model.set_experts_implementation(impl)
        torch.cuda.synchronize()
        t = time.perf_counter()
        if impl == "moelora":
            handle.generate(ids, adapter_names=["a3"], max_new_tokens=new, min_new_tokens=new, **kw)
        else:
            with torch.no_grad():
                model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for impl in ("grouped_mm", "moelora") * 2:
        run(impl, 4), run(impl, 33)
    for impl in ("grouped_mm", "moelora", "moelora", "grouped_mm"):
        per_step = (run(impl, 33) - run(impl, 1)) / 32
        print(f"{impl}: {per_step * 1e3:.3f} ms per decode step (2 MoE layers)")
    model.set_experts_implementation("moelora")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        handle.generate(ids, adapter_names=["a3"], max_new_tokens=9, min_new_tokens=9, **kw)
    print(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
    )
    import cProfile
    import pstats

    py = cProfile.Profile()
    py.enable()
    handle.generate(ids, adapter_names=["a3"], max_new_tokens=9, min_new_tokens=9, **kw)
    py.disable()
    stats = pstats.Stats(py).sort_stats("cumulative")
    stats.print_stats("moelora", 40)


if __name__ == "__main__":
    main()
