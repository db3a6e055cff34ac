"""Model-level FP8 benchmark: a Qwen3-MoE of Qwen3-30B-A3B's shape (random weights,
--layers layers) served by moelora with --adapters PEFT adapters in one mixed batch, in bf16
and then from an FP8 checkpoint of the same model (128x128 block e4m3 experts, W8A8), beside
transformers' own FP8 model; one process, one JSON line per result.

1. bf16: moelora generate tokens/s at each batch (the figure the FP8 run stands beside).
2. The experts quantized layer by layer on the device, written as transformers writes an FP8
   checkpoint (fp8_checkpoint.py), the bf16 model freed, the directory loaded with
   transformers' from_pretrained: where it keeps its FP8Experts (a GPU >= sm89) moelora
   views them, else it holds them dequantized and moelora reads the files.
3. Check: one mixed batch (each adapter, then a base row), its first --check-new tokens and
   its prompt logits: the base row against transformers' own FP8 model generating alone,
   the adapter rows against the W8A8 truth (moelora/truth/w8a8.py: transformers'
   eager experts loop, base GEMMs on quantized inputs, PEFT's delta on the unquantized
   rows). The noise: the base row under transformers' own FP8 experts against the truth;
   every row must be within generate's tolerance (max(bf16 table, 2 x that noise)).
4. FP8 timing: moelora (mixed adapters) and transformers' own FP8 experts (base rows)
   alternating, the order flipped each repeat, after a warm-up at every timed shape.

    python -m benchmarks.fp8_generate --json out/fp8_generate.json
    python -m benchmarks.fp8_generate --tiny   # a CPU run in seconds (tests)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
from pathlib import Path

import torch

from moelora.bench.model_level import add_run_args
from moelora.bench.qwen3_model import SMALL, build

TINY = SMALL  # --tiny, and tests/test_generate_fp8.py's FP8 directories


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, layers=48)
    p.add_argument("--check-prompt", type=int, default=32, help="prompt tokens of the check")
    p.add_argument("--block", type=int, default=128, help="the weight_block_size side")
    p.add_argument("--layout", choices=("per_expert", "fused"), default="per_expert",
                   help="the checkpoint's expert layout (fp8_checkpoint.LAYOUTS)")  # fmt: skip
    p.add_argument("--lora-std", type=float, default=0.02, help="std of the random factors")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="the model's dtype (fp32: the tests' exact check)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="weights, factors and prompts")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU tests)")
    p.add_argument("--fp8-attention", action="store_true",
                   help="q / k / v / o in e4m3 with block scales too, as the published "
                   "checkpoints (moelora computes them; transformers' kernels are the Hub's)")  # fmt: skip
    return p.parse_args(argv)


def write_adapters(model, root: Path, count: int, rank: int, std: float) -> dict[str, Path]:
    """`count` random PEFT target_parameters adapters, saved by PEFT; the model is wrapped in
    place and unwrapped after (no copy of the model)."""
    from peft import LoraConfig, get_peft_model

    lc = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=[], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    pm = get_peft_model(model, lc, adapter_name="a0")
    for k in range(1, count):
        pm.add_adapter(f"a{k}", lc)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    pm.save_pretrained(str(root))  # one subdirectory per adapter name
    pm.unload()
    return {f"a{k}": root / f"a{k}" for k in range(count)}


def main(argv=None) -> list[dict]:
    a = parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # Triton kernels, where chosen, run in its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import transformers as tf

    from benchmarks.fp8_checkpoint import scratch_dir, write_fp8_checkpoint
    from benchmarks.fp8_model import DTYPES, fp8_phase, full_precision_phase

    rows: list[dict] = []  # every result, in order

    def emit(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    import time

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    emit(kind="versions", transformers=tf.__version__, torch=torch.__version__, device=name)
    start = time.monotonic()

    def step(what: str) -> None:  # progress: where a run cut short by its limit stood
        emit(kind="step", done=what, s=round(time.monotonic() - start, 1))

    if a.tiny:
        a.layers, a.block = min(a.layers, 2), 32
    model = build(a.layers, device, a.seed, **(TINY if a.tiny else {})).to(DTYPES[a.dtype])
    step("build")
    sizes = _sizes(model, a)
    ckpt = scratch_dir(sizes["checkpoint"])  # /dev/shm first: the checkpoint is read back
    lora = scratch_dir(sizes["checkpoint"] + sizes["adapters"])  # beside it if both fit
    emit(kind="scratch", checkpoint=str(ckpt), adapters=str(lora),
         **{f"{k}_gib": round(v / 2**30, 2) for k, v in sizes.items()})  # fmt: skip
    try:
        adapters = write_adapters(model, lora / "adapters", a.adapters, a.rank, a.lora_std)
        step("adapters")
        write_fp8_checkpoint(model, ckpt / "model", a.block, a.layout, a.fp8_attention)
        step("fp8 checkpoint")
        full_precision_phase(a, model, adapters, emit, device)
        step("bf16 timing")
        del model  # freed before transformers loads the FP8 directory
        _free(device)
        fp8_phase(a, ckpt / "model", adapters, emit, device)
        step("fp8 phase")
    finally:  # what ran is kept, also when a later step fails
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(lora, ignore_errors=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _sizes(model, a) -> dict[str, int]:
    """Bytes on disk: the FP8 checkpoint (an e4m3 byte per expert weight, the rest as held)
    and the adapters (PEFT saves fp32: r x (in + out) per expert parameter and expert)."""
    experts = non_experts = lora = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            experts += p.numel()
            lora += p.shape[0] * a.rank * (p.shape[1] + p.shape[2]) * 4
        else:
            non_experts += p.numel() * p.element_size()
    return {"checkpoint": experts + non_experts, "adapters": a.adapters * lora}


if __name__ == "__main__":
    main()
