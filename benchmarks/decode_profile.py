"""Where one decode step's GPU time goes (GPU): the engine on a model of Qwen3-30B-A3B's layer
shapes (random bf16, a few layers), per batch size, LoRA-free and with 8 adapters mixed, on
both decode paths: transformers' forward ("hf") and moelora's runner (engine/runner.py).

For each batch: the replayed step's wall time (CUDA graphs, as the engine serves), then the
same step eager under the torch profiler: its kernels' GPU time and count, and on the hf
path their time per part of the model (each part's modules wrapped in a profiler range:
norms, q/k/v/o projections with their LoRA, the attention core with rotary and the cache,
the router, the experts, the LM head with its LoRA, and the rest: masks, sampling,
embedding), per layer where it repeats. The runner's logits are compared with the hf
path's for the same requests (relative error while the tokens agree). The floor beside
it: the bytes one step must read (the weights it touches and the KV cache of its rows)
over the copy bandwidth measured in the same run.

    python -m benchmarks.decode_profile --layers 4 --json $OUT/decode_profile.json
    python -m benchmarks.decode_profile --device cpu   # a dry run on tiny shapes (no timing)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

# Qwen3-30B-A3B's layer shapes (config.json of the released model)
SHAPE = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
             head_dim=128, num_attention_heads=32, num_key_value_heads=4, vocab_size=151936,
             intermediate_size=6144)  # fmt: skip
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            head_dim=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            intermediate_size=128)  # fmt: skip
PARTS = ("norm", "proj", "attention", "router", "experts", "lm_head")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="replayed steps timed per batch")
    p.add_argument("--lora", default="both", choices=["both", "free", "adapters"],
                   help="LoRA-free rows, rows with the adapters, or both (default)")  # fmt: skip
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cpu: tiny shapes, eager, a dry run")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
        args.batches, args.prompt, args.adapters, args.rank, args.steps = "1,3", 8, 2, 4, 2
    return args


def build(args):
    from moelora.hf import attach, toy

    cpu = args.device == "cpu"
    model = toy.build_model("qwen3_moe", seed=0, dtype=torch.float32 if cpu else torch.bfloat16,
                            device=args.device, num_hidden_layers=args.layers,
                            max_position_embeddings=args.prompt + 64,
                            **(TINY if cpu else SHAPE))  # fmt: skip
    tmp = Path(tempfile.mkdtemp())
    fused = toy.expert_parameters(model)
    names = []
    for k in range(args.adapters):  # half with q/k/v/o LoRA, as the mix
        extra = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]} if k % 2 else {}
        toy.write_peft_adapter(model, tmp / f"a{k}", seed=k + 1, r=args.rank,
                               lora_alpha=2 * args.rank, target_parameters=fused, **extra)  # fmt: skip
        names.append(f"a{k}")
    backend = "reference" if cpu else "auto"
    handle = attach(model, num_slots=args.adapters, max_rank=args.rank, moe_backend=backend)
    for n in names:
        handle.load_adapter(tmp / n, name=n)
    return model, handle, names


@contextmanager
def part_ranges(model):
    """Each part's modules run inside a profiler range named part:<part>."""
    undo = []

    def wrap(module, part):
        def pre(mod, args):
            mod._moelora_range = torch.profiler.record_function(f"part:{part}")
            mod._moelora_range.__enter__()

        def post(mod, args, out):
            mod._moelora_range.__exit__(None, None, None)

        undo.append(module.register_forward_pre_hook(pre))
        # appended: the range closes after the LoRA hooks (registered at attach) have run
        undo.append(module.register_forward_hook(post))

    for layer in model.model.layers:
        wrap(layer.input_layernorm, "norm")
        wrap(layer.post_attention_layernorm, "norm")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            wrap(getattr(layer.self_attn, proj), "proj")
        wrap(layer.mlp.gate, "router")
        wrap(layer.mlp.experts, "experts")
    wrap(model.model.norm, "norm")
    wrap(model.lm_head, "lm_head")
    try:
        yield
    finally:
        for u in undo:
            u.remove()


def profile_step(engine, model) -> dict[str, float]:
    """GPU microseconds per part of one eager decode step (attention: the self_attn module
    less its projections; other: kernels outside every part)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with part_ranges(model), _attn_ranges(model), profile(activities=activities) as prof:
        with torch.profiler.record_function("part:step"):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    totals = defaultdict(float)
    kernels = 0
    by_kernel = {}
    for event in prof.key_averages():
        name = event.key
        if name.startswith("part:"):  # on a CPU: host time, the dry run's only clock
            totals[name[5:]] += event.device_time_total if cuda else event.cpu_time_total
        elif event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += event.count
            by_kernel[name] = (event.count, event.device_time_total)
    out = {p: totals.get(p, 0.0) for p in PARTS}
    # self_attn covers proj too: its core is what is left
    out["attention"] = totals.get("self_attn", 0.0) - out["proj"]
    out["other"] = totals.get("step", 0.0) - sum(out[p] for p in PARTS)
    out["total"] = totals.get("step", 0.0)
    out["kernels"] = kernels
    # each kernel's launches and GPU us in the step, the largest first
    out["by_kernel"] = sorted(([n[:90], c, t] for n, (c, t) in by_kernel.items()),
                              key=lambda k: -k[2])  # fmt: skip
    return out


def replay_timeline(engine) -> dict[str, float]:
    """One replayed step under the profiler (CUPTI traces the kernels a CUDA graph runs):
    kernels, their busy GPU time, the span from the first kernel's start to the last one's
    end, so span - busy is the gaps between kernels in the graph and the step's wall time
    less the span the host's share (building inputs, launching, sampling, copying back)."""
    return timeline(engine.step)


def timeline(step) -> dict[str, float]:
    """replay_timeline's figures of one call of `step` (any step, graphed or eager)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")
    )
    busy, reach = 0.0, float("-inf")
    for start, end in spans:  # the union of the kernels' intervals
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    return dict(kernels=len(spans), busy_us=busy, span_us=span)


@contextmanager
def _attn_ranges(model):
    undo = []
    for layer in model.model.layers:
        attn = layer.self_attn

        def pre(mod, args, kwargs):
            mod._moelora_attn = torch.profiler.record_function("part:self_attn")
            mod._moelora_attn.__enter__()

        def post(mod, args, kwargs, out):
            mod._moelora_attn.__exit__(None, None, None)

        undo.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        undo.append(attn.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for u in undo:
            u.remove()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(engine, steps: int) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return 1e3 * (time.perf_counter() - start) / steps


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a copy of 2 GiB on the device (64 MiB on a CPU), read + write counted."""
    size = (1 << 30) if device == "cuda" else (1 << 26)
    a = torch.empty(size, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync()
    return 2 * a.numel() * 10 / (time.perf_counter() - start)


def step_bytes(model, batch: int, kv_len: int, top_k: int) -> int:
    """Bytes one decode step of `batch` rows must read: every weight but the experts, the
    experts the rows route to (at most top_k * batch per layer, at most all), the KV cache
    of each row up to kv_len."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if "experts" in name:
            share = min(1.0, top_k * batch / cfg.num_experts)
            total += int(p.numel() * p.element_size() * share)
        elif "embed_tokens" in name:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * 2 * kv_len * cfg.num_hidden_layers
    return total + batch * kv


def run_batch(model, handle, names, args, batch: int, with_lora: bool, runner: bool) -> dict:
    from moelora.engine import Engine, Request, Sampling

    max_len = args.prompt + 40
    results = {"logits": {}}
    for eager in (False, True) if handle.device.type == "cuda" else (True,):
        engine = Engine(handle, max_rows=max(64, batch), max_len=max_len, enforce_eager=eager,
                        runner=runner)  # fmt: skip
        if not eager:
            engine.warmup()
        g = torch.Generator().manual_seed(batch)
        for i in range(batch):
            vocab = model.config.vocab_size
            prompt = tuple(torch.randint(1, vocab, (args.prompt,), generator=g).tolist())
            adapter = names[i % len(names)] if with_lora else None
            engine.add(Request(f"r{i}", prompt, adapter, Sampling(max_new_tokens=36)))
        if eager:
            _record_logits(engine, results["logits"])
        for _ in range(4):  # the prefill, then decode steps at this bucket
            failed = [e for e in engine.step() if e.error is not None]
            if failed:
                raise RuntimeError(f"a request failed: {failed[0].error!r}")
        if eager:
            profile_step(engine, model)  # a first profiled step pays one-time costs
            results["profile_us"] = profile_step(engine, model)
        if not eager or handle.device.type != "cuda":
            results["step_ms"] = step_ms(engine, args.steps)
        if not eager and handle.device.type == "cuda":
            results["replay"] = replay_timeline(engine)
        engine.close()
    return results


def _record_logits(engine, store: dict) -> None:
    """Keep (token, logits) of every row's first steps (engine._accept wrapped)."""
    accept = engine._accept

    def recording(rows, logits):
        events = accept(rows, logits)
        for r, row_logits in zip(rows, logits):
            got = store.setdefault(r.request.request_id, [])
            if len(got) < 4:
                got.append(row_logits.float().cpu())
        return events

    engine._accept = recording


def agreement(a: dict, b: dict) -> tuple[float, float]:
    """(median, largest) relative error between two runs' logits of the same requests, over
    the steps before their picked tokens first differ. In bf16 a router's k-th expert can
    flip between two correct implementations: such a step differs by tenths, the next
    agrees again, so the median says more than the largest."""
    errs = []
    for rid, steps in a.items():
        for x, y in zip(steps, b.get(rid, [])):
            errs.append(float((x - y).norm() / y.norm()))
            if x.argmax() != y.argmax():
                break
    if not errs:
        return float("nan"), float("nan")
    errs.sort()
    return errs[len(errs) // 2], errs[-1]


def main(argv=None) -> None:
    args = parse(argv)
    model, handle, names = build(args)
    bandwidth = copy_bandwidth(args.device)
    rows = []
    from moelora.engine.runner import runner_support

    paths = ("hf", "runner") if not runner_support(model) else ("hf",)
    for batch in (int(b) for b in args.batches.split(",")):
        for with_lora in {"both": (False, True), "free": (False,), "adapters": (True,)}[args.lora]:
            top_k = model.config.num_experts_per_tok
            floor_ms = 1e3 * step_bytes(model, batch, args.prompt + 8, top_k) / bandwidth
            seen = {}
            for path in paths:
                got = run_batch(model, handle, names, args, batch, with_lora, path == "runner")
                seen[path] = got.pop("logits")
                row = dict(batch=batch, lora=with_lora, path=path, floor_ms=floor_ms, **got)
                if path == "runner":
                    row["rel_err_vs_hf"] = agreement(seen["runner"], seen["hf"])
                rows.append(row)
                _print(row, args.layers)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    about = dict(device=name, torch=torch.__version__,
                 layers=args.layers, prompt=args.prompt, bandwidth_Bps=bandwidth)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(dict(about=about, rows=rows), indent=2))


def _print(row: dict, layers: int) -> None:
    prof, batch = row["profile_us"], row["batch"]
    label = f"{row['path']:6s} batch {batch:3d} {'8 adapters' if row['lora'] else 'LoRA-free '}"
    print(f"{label}: replayed step {row['step_ms']:.3f} ms ({batch / row['step_ms'] * 1e3:.0f} "
          f"tok/s), floor {row['floor_ms']:.3f} ms; eager kernels {prof['total']:.0f} us in "
          f"{prof['kernels']} launches", flush=True)  # fmt: skip
    if "replay" in row:
        r = row["replay"]
        print(f"   replayed: {r['kernels']} kernels busy {r['busy_us']:.0f} us, span "
              f"{r['span_us']:.0f} us (gaps {r['span_us'] - r['busy_us']:.0f}), host "
              f"{row['step_ms'] * 1e3 - r['span_us']:.0f} us of the step", flush=True)  # fmt: skip
    if row["path"] == "hf":
        parts = ("norm", "proj", "attention", "router", "experts")
        print("   per layer us: " + ", ".join(f"{p} {prof[p] / layers:.1f}" for p in parts)
              + f"; lm_head {prof['lm_head']:.1f}, other {prof['other']:.1f}", flush=True)  # fmt: skip
    else:
        median, worst = row["rel_err_vs_hf"]
        print(f"   logits vs hf: rel err median {median:.2e}, largest {worst:.2e}", flush=True)
    for name, count, us in prof["by_kernel"][:KERNELS_SHOWN]:
        print(f"   {us:9.1f} us {count:4d}x  {name}", flush=True)


KERNELS_SHOWN = 14  # the largest kernels printed per row (the JSON has them all)


if __name__ == "__main__":
    main()
