"""Same-run A/B of two source trees on one GPU: this tree against another one (an exported
commit), the triton backend's whole layer at every T of a bench suite, LoRA-free and
+LoRA, and the ratio new / base per T and mode.

One worker process per tree (this file run by path, that tree's package first on the
path, so the two packages never meet in one interpreter) builds the suite's layer once
and times what `moelora bench` times: the backend the oracle selects, CUDA-graph replay,
L2 flushed, fresh inputs copied in before each replay, median of --iters replays, every
output checked against the reference before it is timed. The driver alternates the two
workers per measurement in the order new, base, base, new (ABBA; --reps 3: ABBAAB), so a
drift of the GPU over the call shows as spread, not as a difference, and each tree
compiles its kernels once.

Usage (GPU): python -m benchmarks.ab_trees --base .ab_base --out $OUT [--suite qwen3]
             [--reps 2] [--iters 50] [--tokens 1,16,...]
Writes $OUT/ab.json (every measurement) and $OUT/ab_table.txt (the table it prints).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

NOISE = 0.02  # the bound for "no slowdown": 2%
INPUT_SETS = 4  # as moelora bench: fresh inputs rotate among these


def select_backend(case):
    """The triton backend through the oracle, for exactly what the case times (its model,
    this GPU, LoRA with the case's slots and rank, CUDA graphs), as `moelora bench` asks
    for it; the same calls in both package layouts."""
    from moelora.config import AddInputs, LoRAConfig
    from moelora.deployment import Deployment
    from moelora.device import probe
    from moelora.oracle import select
    from moelora.presets import resolve_model

    sizes = dict(max_rank=case.rank, num_slots=case.adapters)
    if "num_slots" not in {f.name for f in dataclasses.fields(LoRAConfig)}:
        sizes = dict(max_rank=case.rank, max_loras=case.adapters)  # a tree before num_slots
    lora = LoRAConfig(enabled=True, add_inputs=AddInputs.OVERWRITE, **sizes)
    deployment = Deployment.for_model(
        resolve_model(case.model), device=probe(), lora=lora, cuda_graphs=True, backend="triton"
    )
    return select(deployment).backend


def _tree_api():
    """(CASES, build_experts, build_inputs, build_lora, time_graph) of the package on the
    path: the layout since the tiling/ split, or the one before it."""
    try:
        from moelora.bench.cases import CASES
        from moelora.bench.runner import time_graph
        from moelora.inputs import build_experts, build_inputs, build_lora
    except ImportError:  # 5b4b1d5: the runner in benchmarks/, builders in the CLI
        from benchmarks.cases import CASES
        from benchmarks.runner import time_graph
        from moelora.commands.validate import build_experts, build_inputs, build_lora
    return CASES, build_experts, build_inputs, build_lora, time_graph


def _backend_forward(backend, x, ids, w, slots, experts, bank, shape, woi):
    """backend.forward in the tree's form: a per-call record since moelora/call.py, the
    record's fields spelled out before it."""
    try:
        from moelora.call import MoECall
    except ImportError:
        return backend.forward(x, ids, w, slots, experts, bank, shape, weights_on_input=woi)
    return backend.forward(MoECall(x, ids, w, slots, bank, woi), experts, shape)


def _bank(model, case, device, build_lora):
    """The case's bank with every slot at the case's rank (as the vLLM peer's), where the
    tree builds banks of given ranks (build_bank, since real ranks); before that, the
    tree's build_lora, whose padded slots cost the full rank there anyway."""
    try:
        from moelora.inputs import build_bank
    except ImportError:
        return build_lora(model, case.adapters, case.rank, device)
    return build_bank(model, [case.rank] * case.adapters, case.rank, device)


def worker(
    suite: str, model_name: str | None, device: str, adapters: int | None, rank: int | None
) -> None:
    """Serve measurements: a JSON line {"T", "lora", "iters"} in, {"ms", "ok", "rel_err"} out.
    The replies go to the original stdout; anything else printed goes to stderr (the log)."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch

    from moelora.compare import compare
    from moelora.presets import resolve_model
    from moelora.reference import moe_lora_reference

    CASES, build_experts, build_inputs, build_lora, time_graph = _tree_api()
    cases = {c.tokens: c for c in CASES[suite]}
    if model_name:  # another model at the suite's T (the --device cpu smoke test)
        cases = {t: dataclasses.replace(c, model=model_name) for t, c in cases.items()}
    if adapters or rank:  # another LoRA configuration at the suite's T
        change = {k: v for k, v in (("adapters", adapters), ("rank", rank)) if v}
        cases = {t: dataclasses.replace(c, **change) for t, c in cases.items()}
    model = resolve_model(next(iter(cases.values())).model)
    experts = build_experts(model, device)
    woi = model.routing.method.weights_on_input
    checked: dict = {}
    import moelora

    print(json.dumps({"ready": moelora.__file__}), file=reply, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        case = cases[req["T"]]
        if device == "cuda":
            backend = select_backend(case)  # as moelora bench: through the oracle
        else:  # the smoke test: the oracle refuses CUDA graphs on cpu
            from moelora.backends.registry import REGISTRY

            backend = REGISTRY["triton"]
        bank = _bank(model, case, device, build_lora) if req["lora"] else None
        sets = [build_inputs(model, case.tokens, case.adapters, device, s) for s in range(INPUT_SETS)]  # fmt: skip
        for s in sets:  # token t -> slot t % L, as moelora bench and the vLLM peer
            s[3].copy_(torch.arange(case.tokens, device=device) % case.adapters)

        def fwd(x, ids, w, slots, bank=bank, backend=backend):
            return _backend_forward(backend, x, ids, w, slots, experts, bank, model.shape, woi)

        static = tuple(t.clone() for t in sets[0])
        key = (req["T"], req["lora"])
        if key not in checked:  # the reference check, once per (T, mode)
            n = min(case.tokens, 1024)
            out = fwd(*static)
            ref = moe_lora_reference(*(t[:n] for t in static), experts, bank, model.shape, weights_on_input=woi)  # fmt: skip
            checked[key] = compare(out[:n], ref, model.shape.dtype)
        if device == "cuda":
            ms = time_graph(fwd, static, sets, req["iters"])
        else:  # the smoke test: wall time of one eager call, no meaning as a timing
            began = time.perf_counter()
            fwd(*static)
            ms = (time.perf_counter() - began) * 1e3
        cmp = checked[key]
        answer = {"ms": ms, "ok": bool(cmp.ok), "rel_err": float(cmp.rel_err)}
        print(json.dumps(answer), file=reply, flush=True)
        del sets, static, bank
        torch.cuda.empty_cache()


class Worker:
    """A worker process of one tree."""

    def __init__(self, side: str, tree: str, args, log) -> None:
        env = {**os.environ, "PYTHONPATH": tree, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--suite", args.suite]
        cmd += ["--device", args.device] + (["--model", args.model] if args.model else [])
        cmd += ["--adapters", str(args.adapters)] if args.adapters else []
        cmd += ["--rank", str(args.rank)] if args.rank else []
        self.side = side
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
        self.package = ""

    def wait_ready(self) -> None:
        self.package = self._read()["ready"]  # the moelora it imported

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"ab_trees: the {self.side} worker died (see ab.log)")
        return json.loads(line)

    def measure(self, tokens: int, lora: bool, iters: int) -> dict:
        self.proc.stdin.write(json.dumps({"T": tokens, "lora": lora, "iters": iters}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def table(samples: list[dict]) -> list[str]:
    """The ratio table of samples [{T, lora, side, ms, ok}]."""
    ms: dict = {}
    for s in samples:
        ms.setdefault((s["T"], s["lora"], s["side"]), []).append(s["ms"])
    failed = [f"T={s['T']} lora={s['lora']} {s['side']}" for s in samples if not s["ok"]]
    lines = [f"REFERENCE CHECK FAILED: {', '.join(sorted(set(failed)))}"] if failed else []
    lines += [
        "| T | mode | base tree ms | this tree ms | new / base (medians) |",
        "|---:|---|---|---|---:|",
    ]
    worst = 0.0
    for t, lora in sorted({(k[0], k[1]) for k in ms}):
        old, new = ms.get((t, lora, "base"), []), ms.get((t, lora, "new"), [])
        if not old or not new:
            continue
        ratio = statistics.median(new) / statistics.median(old)
        worst = max(worst, ratio)
        flag = " (above 1 + noise)" if ratio > 1 + NOISE else ""
        cells = [" / ".join(f"{v:.4f}" for v in vs) for vs in (old, new)]
        mode = "+LoRA" if lora else "LoRA-free"
        lines.append(f"| {t} | {mode} | {cells[0]} | {cells[1]} | {ratio:.3f}{flag} |")
    verdict = "within" if worst <= 1 + NOISE else "NOT within"
    lines.append(f"worst ratio {worst:.3f}: {verdict} the {NOISE:.0%} noise bound")
    return lines


def _write(args, samples: list[dict]) -> list[str]:
    """ab.json and ab_table.txt from the samples so far; the table's lines."""
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump(dict(suite=args.suite, iters=args.iters, samples=samples), f, indent=1)
    lines = table(samples)
    with open(os.path.join(args.out, "ab_table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="the other tree (a git archive of a commit)")
    p.add_argument("--out", default="out")
    p.add_argument("--suite", default="qwen3")
    p.add_argument("--tokens", default=None, help="a subset of the suite's T")
    p.add_argument("--reps", type=int, default=2, help="measurements per tree per (T, mode)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--model", default=None, help="another model at the suite's T")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the plumbing only")
    p.add_argument("--adapters", type=int, default=None, help="LoRA slots L (the suite's)")
    p.add_argument("--rank", type=int, default=None, help="every slot's rank (the suite's)")
    p.add_argument("--modes", default="base,lora", help="base (LoRA-free), lora, or both")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.suite, args.model, args.device, args.adapters, args.rank)
        return 0
    if not args.base or not os.path.isdir(os.path.join(args.base, "moelora")):
        p.error(f"--base {args.base}: no moelora/ there (a checkout of the base commit)")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, here)
    from moelora.bench.cases import CASES

    tokens = [c.tokens for c in CASES[args.suite]]
    if args.tokens:
        tokens = [t for t in tokens if t in {int(v) for v in args.tokens.split(",")}]
    os.makedirs(args.out, exist_ok=True)
    samples, start = [], time.time()
    with open(os.path.join(args.out, "ab.log"), "w") as log:
        workers = {
            "new": Worker("new", here, args, log),
            "base": Worker("base", os.path.abspath(args.base), args, log),
        }
        for w in workers.values():  # both started first: their setup overlaps
            w.wait_ready()
            print(f"{w.side} worker: {w.package}", flush=True)
        print(f"workers ready in {time.time() - start:.0f} s", flush=True)
        order = ["new", "base", "base", "new", "new", "base"] * args.reps
        for t in tokens:
            for lora in [m == "lora" for m in args.modes.split(",")]:
                for side in order[: 2 * args.reps]:
                    got = workers[side].measure(t, lora, args.iters)
                    samples.append(dict(T=t, lora=lora, side=side, **got))
                row = [s["ms"] for s in samples[-2 * args.reps :]]
                print(f"T={t} lora={lora}: " + " ".join(f"{v:.4f}" for v in row), flush=True)
                lines = _write(args, samples)  # after each T: a time limit keeps what ran
        for w in workers.values():
            w.close()
    print("\n".join(lines))
    print(f"ab_trees: {len(samples)} measurements in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
