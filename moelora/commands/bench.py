"""`moelora bench`: time backends on a preset's MoE layer (CUDA-graph replay, L2 flushed),
base and +LoRA, against the floor measured in the same run (and the vLLM peer's JSON).

Runs from a source checkout: the runner lives in benchmarks/ at the repository root.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, InputError

# what the vLLM peer's JSON may leave unsaid: its tool (.peer/vllm_moe_lora_bench.py) always
# runs SiLU-gated experts without biases, routing weights on the output
PEER_DEFAULTS = dict(activation="silu", bias=False, weights_on_input=False)


def _suites() -> list[str] | None:
    """The suites of benchmarks/cases.py, or None outside a source checkout."""
    try:
        from benchmarks.cases import CASES
    except ModuleNotFoundError:
        return None
    return list(CASES)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time backends vs the floor (and the vLLM peer)",
        description="Whole-layer times under CUDA-graph replay, L2 flushed, each provider "
        "checked against the reference first. Needs a GPU and the source checkout. Exit "
        "codes: 0 every provider matched the reference, 1 one did not, 2 bad usage, 3 a "
        "backend is refused here.",
    )
    suites = _suites()
    p.add_argument(
        "--suite",
        default="qwen3",
        choices=suites,
        help="case list in benchmarks/cases.py: "
        + (
            ", ".join(suites)
            if suites
            else "(`python -m moelora bench --help` from the source checkout lists them)"
        ),
    )
    p.add_argument("--tokens", default=None, help="comma-separated subset of the suite's T")
    p.add_argument(
        "--backends",
        default="triton",
        help="comma-separated backends to time (default triton; also grouped_mm, reference)",
    )
    p.add_argument(
        "--iters", type=int, default=100, help="graph replays timed per case (default 100)"
    )
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--peer-json", default=None, help="vllm_peer.json from the same run")
    p.set_defaults(run=run)


def peer_shape(case) -> dict:
    """The layer a case times, in the peer JSON's "shape" keys (activation, bias and where
    the routing weights apply too: PEER_DEFAULTS when the JSON does not name them)."""
    from ..presets import resolve_model

    model = resolve_model(case.model)
    s = model.shape
    dtype = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(s.dtype), str(s.dtype))
    return dict(
        E=s.num_experts,
        top_k=s.top_k,
        H=s.hidden_size,
        I=s.intermediate_size,
        dtype=dtype,
        max_loras=case.adapters,
        rank=case.rank,
        activation=s.activation.value,
        bias=s.has_bias,
        weights_on_input=model.routing.method.weights_on_input,
    )


def peer_can_run(case) -> bool:
    """Whether the vLLM peer can run the case's layer at all (PEER_DEFAULTS)."""
    shape = peer_shape(case)
    return all(shape[k] == v for k, v in PEER_DEFAULTS.items())


def peer_rows(path: str | None, cases: list) -> dict[int, dict]:
    """The peer's rows by T, from a JSON of the same layer as every case (else an
    InputError naming both shapes: a peer of another layer is never set beside ours)."""
    if not path:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        rows = {int(r["T"]): r for r in data["rows"]}
    except (OSError, KeyError, ValueError) as err:
        print(
            f"moelora bench: warning: peer JSON {path} unreadable ({err}); peer columns left "
            "empty. Fix: pass the vllm_peer.json that .peer/vllm_moe_lora_bench.py wrote",
            file=sys.stderr,
        )
        return {}
    shape = {**PEER_DEFAULTS, **data.get("shape", {})}
    for case in cases:
        want = peer_shape(case)
        got = {k: shape.get(k) for k in want}
        if got != want:
            raise InputError(
                "--peer-json",
                f"{path}, a peer run of the layer {got}",
                f"a peer run of {case.id}'s layer {want}: run .peer/vllm_moe_lora_bench.py "
                f"--experts {want['E']} --topk {want['top_k']} --hidden {want['H']} "
                f"--inter {want['I']} --max-loras {want['max_loras']} --rank {want['rank']} "
                f"--dtype {want['dtype']} (the peer runs only SiLU-gated experts without "
                "biases, routing weights on the output)",
            )
    return rows


def select_backend(name: str, case):
    """The backend `name` through the oracle, for exactly what the case times (its model,
    this GPU, LoRA with the case's slots and rank, CUDA graphs): a backend the oracle would
    refuse is never timed (the refusal raises, naming the failing capabilities)."""
    import logging

    from ..config import AddInputs, LoRAConfig
    from ..deployment import Deployment
    from ..device import probe
    from ..oracle import select
    from ..presets import resolve_model

    lora = LoRAConfig(
        enabled=True,
        max_rank=case.rank,
        max_loras=case.adapters,
        add_inputs=AddInputs.OVERWRITE,  # forward without `out` writes y
    )
    deployment = Deployment.for_model(
        resolve_model(case.model), device=probe(), lora=lora, cuda_graphs=True, backend=name
    )
    oracle_log = logging.getLogger("moelora.oracle")
    level = oracle_log.level
    oracle_log.setLevel(logging.WARNING)  # one selection per case: keep the output short
    try:
        return select(deployment).backend
    finally:
        oracle_log.setLevel(level)


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print(
            "moelora bench: no CUDA device here: bench times GPU kernels. Fix: run it on a GPU "
            "machine (on a CPU, `moelora demo` and `moelora validate --device cpu` run)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        from benchmarks.cases import CASES
        from benchmarks.floors import measure_ceilings
        from benchmarks.runner import dump, run_case, stamp
    except ModuleNotFoundError:
        print(
            "moelora bench: benchmarks/ is not importable (it is not installed with the "
            "package). Fix: run `python -m moelora bench` from the root of the moelora "
            "source checkout",
            file=sys.stderr,
        )
        return EXIT_USAGE
    cases = CASES[args.suite]
    if args.tokens:
        keep = {int(t) for t in args.tokens.split(",")}
        cases = [c for c in cases if c.tokens in keep]
    ceil = measure_ceilings()
    print(
        f"ceilings: copy {ceil.bandwidth / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul / 1e12:.0f} TFLOP/s"
    )
    peer = peer_rows(args.peer_json, cases)
    rows, failed = [], False
    cache: dict = {}
    for name in args.backends.split(","):
        for i, case in enumerate(cases):
            print(f"[{i + 1}/{len(cases)}] {name} {case.id}", flush=True)
            row = run_case(select_backend(name, case), case, ceil, args.iters, cache)
            row["backend"] = name
            p = peer.get(case.tokens)
            if p:
                row["peer"] = {
                    k: p.get(k) for k in ("base_ms", "lora_ms", "base_pre_ms", "lora_pre_ms")
                }
            failed |= not (row["base"]["ok"] and row["lora"]["ok"])
            rows.append(row)
    print(
        f"\n{'backend':<8} {'T':>6} {'base ms':>8} {'floor':>7} {'x':>5} {'lora ms':>8} "
        f"{'floor':>7} {'x':>5} {'TFLOP/s':>7} {'GB/s':>6} {'vllm b/l pre':>13} "
        f"{'vs vllm l':>9}"
    )
    for r in rows:
        b, lo, p = r["base"], r["lora"], r.get("peer") or {}
        vb, vl = p.get("base_pre_ms"), p.get("lora_pre_ms")
        peer_s = f"{vb:.3f}/{vl:.3f}" if vb and vl else "-"
        speed = f"{vl / lo['ms']:.2f}x" if vl else "-"
        print(
            f"{r['backend']:<8} {r['T']:>6} {b['ms']:8.3f} {b['floor_ms']:7.3f} "
            f"{b['ratio']:5.2f} {lo['ms']:8.3f} {lo['floor_ms']:7.3f} {lo['ratio']:5.2f} "
            f"{lo['tflops']:7.1f} {lo['gbps']:6.0f} {peer_s:>13} {speed:>9}"
        )
    if args.json:
        dump(args.json, dict(**stamp(ceil), suite=args.suite, rows=rows))
    print(
        "bench: all providers matched the reference"
        if not failed
        else "bench: SOME PROVIDERS FAILED THE REFERENCE CHECK (times still listed)"
    )
    return EXIT_FAILED if failed else EXIT_OK
