"""GPU check of the decode runner for every family it knows (moelora/engine/runner.py:
FAMILIES), PASS / FAIL lines and a JSON record. Per family, a small random model (gpt-oss
with a sliding-window layer and attention sinks; DeepSeek-V3 with latent attention, a dense
layer and shared experts; Llama 4 with chunked attention and a NoPE layer; Qwen3.5-MoE with
linear-attention layers) with two PEFT adapters (the attention projections + expert LoRA,
expert-only), rows joining at two steps:

1. fp32: the runner's rows equal HF + PEFT generating each row alone (tokens equal, every
   step's logits within fp32's tolerance);
2. bf16: each row's logits, every step on the runner's own tokens, against HF + PEFT in
   fp32 on those tokens, within the bf16 table's tolerance or twice the noise of HF + PEFT
   in bf16 against fp32 on them (measured in the same run), whichever is larger; the rows
   of transformers' forward on the same engine (runner off) beside them, and the tokens
   equal between the two paths counted.

    python scripts/gpu_runner_families.py --out /tmp/families     # on the H200
    TRITON_INTERPRET=1 python scripts/gpu_runner_families.py --device cpu --tiny   # dry run
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

NEW = 6
# the experts' widths at 64: transformers' grouped_mm experts (the bf16 truth) need rows of a
# multiple of 16 bytes ("strides should be multiple of 16 bytes" at the toy's 12)
SIZES = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=256, moe_intermediate_size=64,
             intermediate_size=64)  # fmt: skip
# latent attention at widths cuBLAS and grouped_mm take in bf16; config.head_dim is DeepSeek's
# rotary width
MLA_SIZES = dict(num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32,
                 qk_rope_head_dim=16, v_head_dim=32, head_dim=16)  # fmt: skip
OVERRIDES = {
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    # DeepSeek-V2-Lite's layout: q_proj (no q_a / q_b), complex rotary pairs
    "deepseek_v2": {**MLA_SIZES, "q_lora_rank": None},
    # DeepSeek-V3's published layout: q through q_a / q_b, interleaved rotary pairs
    "deepseek_v3": {**MLA_SIZES, "q_lora_rank": 48},
    # Llama 4's layout: chunked attention on the rotary layers (chunks of 8: the prompts
    # cross them), a NoPE layer with attention temperature, a dense layer between MoE ones
    "llama4_text": dict(
        num_hidden_layers=3,
        moe_layers=[0, 2],
        no_rope_layers=[1, 0, 1],
        attention_chunk_size=8,
        floor_scale=4,
        intermediate_size_mlp=128,
    ),
    # Qwen3.5-MoE's layout: linear-attention (Gated DeltaNet) layers around a gated
    # full-attention one, two value heads per key head
    "qwen3_5_moe_text": dict(
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        shared_expert_intermediate_size=64,
    ),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
             "kv_a_proj_with_mqa", "kv_b_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
             "in_proj_a", "out_proj")  # fmt: skip


def parse(argv):
    from moelora.engine.runner import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_runner_families.json")
    p.add_argument("--tiny", action="store_true", help="toy sizes (a CPU dry run)")
    return p.parse_args(argv)


def _adapters(model) -> dict[str, dict]:
    from moelora.hf import toy

    experts = toy.expert_parameters(model)
    names = {n.split(".")[-1] for n, _ in model.named_modules()}
    return {
        "attention+experts": dict(r=4, lora_alpha=8, target_parameters=experts,
                                  target_modules=[n for n in ATTENTION if n in names]),
        "experts": dict(r=8, lora_alpha=16, target_parameters=experts),
    }  # fmt: skip


def _run(handle, names, prompts, runner: bool, device):
    """(tokens, logits per step) of each row through an engine with or without the runner."""
    from moelora.engine import Engine, Request, Sampling
    from moelora.engine import engine as engine_module

    logits: dict[str, list] = {}
    real_accept, real_next = engine_module.Engine._accept, engine_module.next_tokens
    current: list[str] = []

    def accept(engine, rows, out):
        current[:] = [r.request.request_id for r in rows]
        return real_accept(engine, rows, out)

    def record(out, rows, generated):
        for rid, row in zip(current, out):
            logits.setdefault(rid, []).append(row.detach().float().cpu())
        return real_next(out, rows, generated)

    engine_module.Engine._accept, engine_module.next_tokens = accept, record
    try:
        engine = Engine(handle, max_rows=4, max_len=64, enforce_eager=True, runner=runner)
        reqs = [Request(f"r{i}", p, n, Sampling(max_new_tokens=NEW))
                for i, (n, p) in enumerate(zip(names, prompts))]  # fmt: skip
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        step = 0
        while step == 0 or engine.has_work:
            for r in reqs[:2] if step == 0 else reqs[2:] if step == 1 else []:
                engine.add(r)
            for event in engine.step():
                if event.error is not None:  # the step's own error, not a KeyError later
                    raise RuntimeError(f"request {event.request_id} failed") from event.error
                if event.token_id >= 0:
                    tokens[event.request_id].append(event.token_id)
            step += 1
        engine.close()
    finally:
        engine_module.Engine._accept, engine_module.next_tokens = real_accept, real_next
    return [tokens[r.request_id] for r in reqs], [torch.stack(logits[r.request_id]) for r in reqs]


def family_check(family: str, device: str, check, tiny: bool = False) -> None:
    from moelora.compare import REL_TOL, compare
    from moelora.engine.support import engine_support
    from moelora.hf import attach, toy

    tmp = Path(tempfile.mkdtemp())
    sizes = ({} if tiny else SIZES) | OVERRIDES.get(family, {})
    model = toy.build_model(family, seed=7, **sizes)
    dirs = {}
    for i, (name, kw) in enumerate(_adapters(model).items()):
        dirs[name] = tmp / name
        toy.write_peft_adapter(model, dirs[name], seed=11 + i, scale=0.1, **kw)
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prompts = [tuple(torch.randint(1, vocab, (n,), generator=g).tolist()) for n in (12, 5, 20)]
    names = [*dirs, None]
    import peft

    fp32_truths = None
    # bf16 on a GPU only: Triton's interpreter computes bf16 wrongly (and transformers'
    # grouped experts refuse the toy's 12-wide bf16 rows on a CPU)
    dtypes = (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        base = copy.deepcopy(model).to(device=device, dtype=dtype)
        truths = {n: peft.PeftModel.from_pretrained(copy.deepcopy(base), d).eval()
                  for n, d in dirs.items()}  # fmt: skip
        truths[None] = copy.deepcopy(base)
        if dtype == torch.float32:
            fp32_truths = {n: copy.deepcopy(t) for n, t in truths.items()}
        handle = attach(base, num_slots=2, max_rank=8)
        for n, d in dirs.items():
            handle.load_adapter(d, name=n)
        mine, mine_logits = _run(handle, names, prompts, True, device)
        tol = REL_TOL[dtype]
        if dtype == torch.float32:
            worst, equal = 0.0, 0
            for i, (n, p) in enumerate(zip(names, prompts)):
                ids = torch.tensor(p, device=device)
                with torch.no_grad():
                    out = truths[n].generate(input_ids=ids[None], max_new_tokens=NEW,
                                             do_sample=False, pad_token_id=0)  # fmt: skip
                    ref_tokens = out[0, len(p) :].tolist()
                    full = torch.cat([ids, torch.tensor(mine[i][:-1], device=device)])[None]
                    ref = truths[n](input_ids=full).logits[0, len(p) - 1 :].float().cpu()
                equal += ref_tokens == mine[i]
                worst = max(worst, compare(mine_logits[i], ref, tol=float("inf")).rel_err)
            check(f"{family} fp32 vs HF + PEFT alone", equal == len(names) and worst <= tol,
                  {"rows_equal": f"{equal}/{len(names)}", "rel_err": worst, "tol": tol})  # fmt: skip
        else:
            paths = [("runner", mine, mine_logits)]
            if not engine_support(handle.model):  # (Llama 4's NoPE temperature: runner only)
                theirs, theirs_logits = _run(handle, names, prompts, False, device)
                paths.append(("forward", theirs, theirs_logits))
            worst = {name: 0.0 for name, _, _ in paths} | {"noise": 0.0}
            equal = (f"{sum(a == b for a, b in zip(mine, paths[1][1]))}/{len(names)}"
                     if len(paths) > 1 else "no forward path")  # fmt: skip
            for i, (n, p) in enumerate(zip(names, prompts)):
                for path, toks, got in ((name, t[i], lg[i]) for name, t, lg in paths):
                    ids = torch.tensor([*p, *toks[:-1]], device=device)[None]
                    with torch.no_grad():
                        exact = fp32_truths[n](input_ids=ids).logits[0, len(p) - 1 :].float().cpu()
                        plain = truths[n](input_ids=ids).logits[0, len(p) - 1 :].float().cpu()
                    worst[path] = max(worst[path], compare(got, exact, tol=float("inf")).rel_err)
                    noise = compare(plain, exact, tol=float("inf")).rel_err
                    worst["noise"] = max(worst["noise"], noise)
            bound = max(tol, 2 * worst["noise"])
            check(f"{family} bf16 vs HF + PEFT in fp32", worst["runner"] <= bound,
                  {**worst, "tol": bound, "tokens_equal_between_paths": equal})  # fmt: skip
        handle.detach()


def main(argv=None) -> int:
    args = parse(argv)
    result, ok = {"args": {k: str(v) for k, v in vars(args).items()}}, True

    def check(name, passed, detail):
        nonlocal ok
        ok &= bool(passed)
        result.setdefault("checks", {})[name] = {"pass": bool(passed), **detail}
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)

    for family in args.families.split(","):
        try:
            family_check(family, args.device, check, args.tiny)
        except Exception as err:  # one family's failure is reported, the others still run
            cause = err.__cause__ or err  # a failed request: the step's own error
            where = traceback.extract_tb(cause.__traceback__)[-3:]  # where it broke
            check(f"{family} ran", False, {"error": f"{type(err).__name__}: {err}: {cause!r}"[:400],
                                           "at": [f"{f.filename}:{f.lineno} {f.name}" for f in where]})  # fmt: skip
    result["ok"] = ok
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_runner_families.json").write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
