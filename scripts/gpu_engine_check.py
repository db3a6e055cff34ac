"""GPU check of the decode engine's CUDA-graph path (moelora/engine/engine.py), PASS / FAIL lines
and a JSON record:

1. startup: every decode bucket (and on the runner every token bucket of the steps with
   prompt chunks) captured up front (warmup), seconds and buckets;
2. graph vs eager: the same continuously batched requests (expert-only adapters, base rows,
   prompts of different lengths, rows joining at later steps: on the runner those steps
   replay the prompt-step graphs, engine/mixed_graphs.py) through a graph engine and an
   eager engine: each token's logits within the dtype tolerance while the tokens agree, and
   the share of equal tokens;
3. an adapter replaced between two runs: the graph engine's rows follow the new version
   (equal to the eager engine's) without a new capture;
4. rows with attention LoRA (moelora module banks) in the batch: graphs equal eager;
5. handle.generate (engine, graphs by default) equals the eager engine row by row;
6. decode tokens/s of eager and graph engines at batch 1 / 16 / 64 (timed after prefill);
7. the paged KV cache (on the runner): a graph engine with blocks for one row of max_len
   runs 6 rows of --paged-new tokens (preemptions by recompute) equal to the eager engine;
   a graph engine of default blocks runs 12 rows twice: the second run reads their prompts'
   blocks from the prefix cache and equals the first.

    python scripts/gpu_engine_check.py --out /tmp/engine_check      # on the H200
    python scripts/gpu_engine_check.py --device cpu --layers 2      # dry run (graphs off)
    TRITON_INTERPRET=1 python scripts/gpu_engine_check.py --device cpu --layers 1 --hidden 128 \
        --experts 8 --max-rows 4 --new-tokens 3 --batches 1 --runner on --paged-new 24 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ADAPTERS = ("fused-r8", "fused-r2", "modules-r4", "fused-r4-attn")
EXPERT_ONLY = ("fused-r8", "fused-r2", "modules-r4", None)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--moe-backend", default="auto")
    p.add_argument("--max-rows", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--batches", default="1,16,64", help="batch sizes timed in item 6")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_engine_check.json")
    p.add_argument("--paged-new", type=int, default=40, help="new tokens of item 7's rows")
    p.add_argument("--runner", choices=("auto", "on"), default="auto",
                   help="moelora's decode runner: auto (on a GPU) or on (also on a CPU)")  # fmt: skip
    return p.parse_args(argv)


def build(args):
    from moelora.hf import attach, toy

    dtype = getattr(torch, args.dtype)
    model = toy.build_model(
        "qwen3_moe", seed=0, dtype=dtype, device=args.device, hidden_size=args.hidden,
        moe_intermediate_size=args.hidden // 2, num_experts=args.experts, num_experts_per_tok=8,
        num_hidden_layers=args.layers, head_dim=64, num_attention_heads=args.hidden // 64,
        num_key_value_heads=min(4, args.hidden // 64), vocab_size=8192, intermediate_size=2 * args.hidden,
        max_position_embeddings=256,
    )  # fmt: skip
    handle = attach(model, num_slots=4, max_rank=16, moe_backend=args.moe_backend)
    tmp = Path(tempfile.mkdtemp())
    specs = toy.demo_adapters(model)
    for i, name in enumerate(ADAPTERS):
        toy.write_peft_adapter(model, tmp / name, seed=i + 1, scale=0.05, **specs[name])
        handle.load_adapter(tmp / name, name=name)
    return handle, tmp


def requests(seed: int, names, new: int, vocab: int = 8192):
    from moelora.engine import Request, Sampling

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, name in enumerate(names):
        n = int(torch.randint(4, 40, (1,), generator=g))
        prompt = tuple(torch.randint(1, vocab, (n,), generator=g).tolist())
        out.append(Request(f"r{i}", prompt, name, Sampling(max_new_tokens=new)))
    return out


def drive(engine, reqs, per_join: int = 4):
    """Run reqs (per_join of them joining every second step); id -> (tokens, logits [n, V])."""
    from moelora.engine import engine as engine_module

    tokens, logits, current = {}, {}, []
    real, accept = engine_module.next_tokens, type(engine)._accept

    def record(step_logits, rows, generated):
        for rid, row in zip(current, step_logits):
            logits.setdefault(rid, []).append(row.float().cpu())
        return real(step_logits, rows, generated)

    def tracked(self, rows, step_logits):
        current[:] = [r.request.request_id for r in rows]
        return accept(self, rows, step_logits)

    engine_module.next_tokens, type(engine)._accept = record, tracked
    try:
        pending, step = list(reqs), 0
        while pending or engine.has_work:
            if step % 2 == 0:  # up to per_join rows, in order, while the engine has room
                joined = 0
                while pending and joined < per_join and engine.admissible(pending[0]) is None:
                    engine.add(pending.pop(0))
                    joined += 1
            for e in engine.step():
                tokens.setdefault(e.request_id, []).append(e.token_id)
            step += 1
    finally:
        engine_module.next_tokens, type(engine)._accept = real, accept
    return {rid: (tokens[rid], torch.stack(logits[rid])) for rid in tokens}


def agreement(a, b, dtype):
    """(worst logits rel err over each row's common token prefix, share of equal tokens)."""
    from moelora.compare import compare

    worst, equal, total = 0.0, 0, 0
    for rid, (ta, la) in a.items():
        tb, lb = b[rid]
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        upto = min(same + 1, len(la), len(lb))  # the first differing token's logits still count
        worst = max(worst, compare(la[:upto], lb[:upto], dtype).rel_err)
        equal += sum(x == y for x, y in zip(ta, tb))
        total += max(len(ta), len(tb))
    return worst, equal / total


def decode_rate(engine, batch: int, new: int, seed: int) -> float:
    """Decode tokens/s of `batch` rows after their prefill step."""
    reqs = requests(seed, [EXPERT_ONLY[i % 4] for i in range(batch)], new)
    for r in reqs:
        engine.add(r)
    engine.step()  # prefill
    sync()
    start, made = time.perf_counter(), 0
    while engine.has_work:
        made += len(engine.step())
    sync()
    return made / (time.perf_counter() - start)


def paged_check(check, handle, names, args, runner, eager, dtype, tol) -> None:
    """Item 7: preemption by recompute and prefix caching, against the eager engine."""
    from moelora.engine import Engine

    if eager.pool is None:
        print("SKIP paged KV cache: the engine is not on the runner here (--runner on)")
        return
    per_row = -(-128 // 16)
    small = Engine(handle, max_rows=args.max_rows, max_len=128, runner=runner, block_size=16,
                   num_blocks=per_row + 1)  # fmt: skip
    small.warmup()
    reqs = requests(5, names[:6], args.paged_new)  # rows growing by paged_new / 16 blocks
    p_out, e_out = drive(small, reqs), drive(eager, reqs)
    worst, share = agreement(p_out, e_out, dtype)
    check("paged: preempted rows equal eager", worst <= tol and small.preemptions > 0,
          {"rel_err": worst, "equal_tokens": share, "preemptions": small.preemptions,
           "blocks_back": small.pool.used == 0})  # fmt: skip
    small.close()
    big = Engine(handle, max_rows=args.max_rows, max_len=128, runner=runner)
    big.warmup()
    first = drive(big, requests(6, names, args.new_tokens))
    again = drive(big, requests(6, names, args.new_tokens))
    worst, share = agreement(again, first, dtype)
    check("paged: prefix-cache hits equal the first run",
          worst <= tol and big.pool.stats.hits > 0,
          {"rel_err": worst, "equal_tokens": share, "hit_tokens": big.pool.stats.hits,
           "blocks_back": big.pool.used == 0})  # fmt: skip
    big.close()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> int:
    from moelora.compare import REL_TOL
    from moelora.engine import Engine

    args = parse(argv)
    dtype = getattr(torch, args.dtype)
    tol = REL_TOL[dtype]
    handle, tmp = build(args)
    result, ok = {"args": {k: str(v) for k, v in vars(args).items()}}, True

    def check(name, passed, detail):
        nonlocal ok
        ok &= bool(passed)
        result.setdefault("checks", {})[name] = {"pass": bool(passed), **detail}
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}")

    runner = True if args.runner == "on" else None
    eager = Engine(handle, max_rows=args.max_rows, max_len=128, enforce_eager=True, runner=runner)
    graphs = Engine(handle, max_rows=args.max_rows, max_len=128, runner=runner)
    report = graphs.warmup()
    result["startup"] = (
        None
        if report is None
        else {"seconds": report.seconds, "buckets": list(report.buckets),
              "prompt_buckets": list(report.prompt_buckets)}
    )  # fmt: skip
    print(f"startup: {report}" if report else "startup: no graphs on this device")

    names = [EXPERT_ONLY[i % 4] for i in range(12)]
    g_out, e_out = (
        drive(graphs, requests(1, names, args.new_tokens)),
        drive(eager, requests(1, names, args.new_tokens)),
    )
    worst, share = agreement(g_out, e_out, dtype)
    # rows join while others decode: those steps replay the prompt-step graphs on the runner
    prompt_graphs = list(graphs.mixed.graphs.captured) if graphs.mixed is not None else None
    check("graph equals eager", worst <= tol and prompt_graphs != [],
          {"rel_err": worst, "tol": tol, "equal_tokens": share,
           "prompt_step_graphs": prompt_graphs})  # fmt: skip

    captured = graphs.graphs.captured if graphs.graphs else ()
    handle.load_adapter(tmp / "fused-r2", name="fused-r8")  # replace: rows must follow it
    g_out, e_out = (
        drive(graphs, requests(2, names, args.new_tokens)),
        drive(eager, requests(2, names, args.new_tokens)),
    )
    worst, share = agreement(g_out, e_out, dtype)
    same_graphs = (graphs.graphs.captured if graphs.graphs else ()) == captured
    check("replaced adapter followed", worst <= tol and same_graphs,
          {"rel_err": worst, "equal_tokens": share, "no_new_capture": same_graphs})  # fmt: skip

    mixed = [n if i % 3 else "fused-r4-attn" for i, n in enumerate(names)]
    g_out, e_out = (
        drive(graphs, requests(3, mixed, args.new_tokens)),
        drive(eager, requests(3, mixed, args.new_tokens)),
    )
    worst, share = agreement(g_out, e_out, dtype)
    check("attention-LoRA rows", worst <= tol, {"rel_err": worst, "equal_tokens": share})

    reqs = requests(4, names[:8], args.new_tokens)
    e_out = drive(eager, reqs, per_join=len(reqs))
    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.zeros(len(reqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    out = handle.generate(ids.to(args.device), adapter_names=names[:8], attention_mask=mask.to(args.device),
                          max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
    equal = sum(out[i, width:].tolist() == e_out[f"r{i}"][0] for i in range(len(reqs)))
    check(
        "handle.generate on the engine",
        equal >= len(reqs) // 2,
        {"rows_equal_eager": f"{equal}/{len(reqs)}"},
    )

    paged_check(check, handle, names, args, runner, eager, dtype, tol)

    rates = {}
    for batch in [int(b) for b in args.batches.split(",") if int(b) <= args.max_rows]:
        rates[batch] = {
            kind: decode_rate(engine, batch, 32, seed=batch)
            for kind, engine in (("eager", eager), ("graphs", graphs))
        }
        print(
            f"decode tokens/s at batch {batch}: eager {rates[batch]['eager']:.0f}, graphs {rates[batch]['graphs']:.0f}"
        )
    result["decode_tokens_per_s"] = rates
    result["ok"] = ok
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_engine_check.json").write_text(json.dumps(result, indent=1))
    eager.close()
    graphs.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
