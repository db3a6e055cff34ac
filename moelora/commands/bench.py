"""`moelora bench`: time backends on a preset's MoE layer (CUDA-graph replay, L2 flushed),
base and +LoRA, against the floor measured in the same run (and the vLLM peer's JSON).

The case registry, the runner and the peer's shape rules are moelora.bench (installed with
the package).
"""

from __future__ import annotations

import argparse
import sys

from ..errors import EXIT_FAILED, EXIT_OK, EXIT_REFUSED, EXIT_USAGE, UnsupportedDeploymentError
from .flag_types import positive_int, positive_ints


def _suites() -> list[str]:
    """The suites of moelora/bench/cases.py (installed with the package)."""
    from ..bench.cases import CASES

    return list(CASES)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time backends vs the floor (and the vLLM peer)",
        description="Whole-layer times under CUDA-graph replay, L2 flushed, each provider "
        "checked against the reference first. Needs a GPU. Exit "
        "codes: 0 every provider matched the reference, 1 one did not, 2 bad usage, 3 a "
        "backend is refused here.",
    )
    suites = _suites()
    p.add_argument(
        "--suite",
        default="qwen3",
        choices=suites,
        help="case list in moelora/bench/cases.py: " + ", ".join(suites),
    )
    p.add_argument(
        "--tokens", type=positive_ints, default=None, help="comma-separated subset of the suite's T"
    )
    p.add_argument(
        "--cases",
        default=None,
        help="comma-separated pieces of case ids: only the cases whose id contains one "
        "(e.g. R=256,T=4096/L=64/)",
    )
    p.add_argument(
        "--backends",
        default="triton",
        help="comma-separated backends to time (default triton; also grouped_mm, reference)",
    )
    p.add_argument(
        "--iters", type=positive_int, default=100, help="graph replays timed per case (default 100)"
    )
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument(
        "--peer-json",
        default=None,
        help="vllm_peer.json from the same run, of the suite's one (adapters, rank) (the "
        "lora-sweep suite spans several: benchmarks/lora_sweep_report.py sets each peer JSON "
        "beside its cases)",
    )
    p.add_argument(
        "--model-level",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="OPTIONS",
        help="instead of the layer suites, a whole transformers model decoding with many "
        "adapters (Qwen3-30B-A3B's shape, random weights): transformers' generate beside "
        "moelora's at batch 1 / 16 / 64 against the memory floor; the options after it are "
        "that run's (`moelora bench --model-level --help`)",
    )
    p.set_defaults(run=run)


def select_backend(name: str, case):
    """The backend `name` through the oracle, for exactly what the case times (its model,
    this GPU, LoRA with the case's slots and bank rank, CUDA graphs)."""
    from ..device import probe
    from ..presets import resolve_model
    from .case_backend import case_backend

    return case_backend(
        name,
        resolve_model(case.model),
        probe(),
        adapters=case.adapters,
        max_rank=case.max_rank,
        cuda_graphs=True,
        quantization=case.quantization,
    )


def select_cases(cases: list, tokens: tuple[int, ...] | None, pieces: str | None) -> list:
    """The cases at one of the T of `tokens` whose id contains one of the comma-separated
    `pieces` (None: no filter)."""
    if tokens:
        cases = [c for c in cases if c.tokens in tokens]
    if pieces:
        wanted = [p for p in pieces.split(",") if p]
        cases = [c for c in cases if any(p in c.id for p in wanted)]
    return cases


def run(args: argparse.Namespace) -> int:
    import torch

    if args.model_level is not None:
        return _model_level(args)

    if not torch.cuda.is_available():
        print(
            "moelora bench: no CUDA device here: bench times GPU kernels. Fix: run it on a GPU "
            "machine (on a CPU, `moelora demo` and `moelora validate --device cpu` run)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from ..bench.cases import CASES
    from ..bench.floors import measure_ceilings
    from ..bench.peer import peer_rows
    from ..bench.runner import dump, stamp

    cases = select_cases(CASES[args.suite], args.tokens, args.cases)
    if not cases:
        print(
            f"moelora bench: no case of suite {args.suite!r} matches --tokens "
            f"{','.join(map(str, args.tokens or ()))} "
            f"--cases {args.cases}. Fix: `moelora bench --suite {args.suite}` without them "
            "runs every case (ids in moelora/bench/cases.py)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    ceil = measure_ceilings()
    print(
        f"ceilings: copy {ceil.bandwidth / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul / 1e12:.0f} TFLOP/s"
    )
    peer = peer_rows(args.peer_json, cases)
    head = dict(**stamp(ceil), suite=args.suite)

    def save(rows: list[dict], complete: bool) -> None:
        if args.json:  # after every case: a run cut short by its time limit keeps its rows
            dump(args.json, dict(**head, complete=complete, rows=rows))

    rows = _run_cases(args, cases, ceil, peer, save)
    save(rows, complete=True)
    timed = [r for r in rows if "refused" not in r]
    _print_table(timed)
    failed = any(not (r["base"]["ok"] and r["lora"]["ok"]) for r in timed)
    refused = len(rows) - len(timed)
    print(
        "bench: SOME PROVIDERS FAILED THE REFERENCE CHECK (times still listed)"
        if failed
        else "bench: all providers matched the reference"
        + (f"; {refused} case(s) refused by the oracle (not timed)" if refused else "")
    )
    return EXIT_FAILED if failed else EXIT_REFUSED if refused else EXIT_OK


def _run_cases(args: argparse.Namespace, cases: list, ceil, peer: dict, save) -> list[dict]:
    """One row per (backend, case): timed, or {"refused": why} where the oracle refuses the
    case (a sweep goes on past a bank the backend cannot run yet; the row says so); each
    saved as it comes (save(rows, complete=False))."""
    from ..bench.runner import run_case

    rows: list[dict] = []
    cache: dict = {}
    for name in args.backends.split(","):
        for i, case in enumerate(cases):
            print(f"[{i + 1}/{len(cases)}] {name} {case.id}", flush=True)
            try:
                backend = select_backend(name, case)
            except UnsupportedDeploymentError as err:
                why = " ".join(str(err).split())
                print(f"  refused: {why}", flush=True)
                rows.append(dict(case=case.id, T=case.tokens, backend=name, refused=why))
                save(rows, complete=False)
                continue
            row = run_case(backend, case, ceil, args.iters, cache)
            row["backend"] = name
            p = peer.get(case.tokens)
            if p:
                row["peer"] = {
                    k: p.get(k) for k in ("base_ms", "lora_ms", "base_pre_ms", "lora_pre_ms")
                }
            rows.append(row)
            save(rows, complete=False)
    return rows


def _print_table(rows: list[dict]) -> None:
    print(
        f"\n{'backend':<8} {'T':>6} {'base ms':>8} {'floor':>7} {'x':>5} {'lora ms':>8} "
        f"{'floor':>7} {'x':>5} {'TFLOP/s':>7} {'GB/s':>6} {'vllm b/l pre':>13} "
        f"{'vs vllm l':>9}  case"
    )
    for r in rows:
        b, lo, p = r["base"], r["lora"], r.get("peer") or {}
        vb, vl = p.get("base_pre_ms"), p.get("lora_pre_ms")
        peer_s = f"{vb:.3f}/{vl:.3f}" if vb and vl else "-"
        speed = f"{vl / lo['ms']:.2f}x" if vl else "-"
        print(
            f"{r['backend']:<8} {r['T']:>6} {b['ms']:8.3f} {b['floor_ms']:7.3f} "
            f"{b['ratio']:5.2f} {lo['ms']:8.3f} {lo['floor_ms']:7.3f} {lo['ratio']:5.2f} "
            f"{lo['tflops']:7.1f} {lo['gbps']:6.0f} {peer_s:>13} {speed:>9}  {r['case']}"
        )


# the layer-suite options and their defaults: given with --model-level, they are refused
_LAYER_OPTIONS = {"suite": "qwen3", "tokens": None, "cases": None, "backends": "triton",
                  "iters": 100, "peer_json": None, "json": None}  # fmt: skip


def _model_level(args: argparse.Namespace) -> int:
    """The model-level run (moelora/bench/model_level.py) with the options after
    --model-level; the layer suites' options before it are refused, named."""
    given = [k for k, default in _LAYER_OPTIONS.items() if getattr(args, k) != default]
    if given:
        names = ", ".join("--" + k.replace("_", "-") for k in given)
        print(f"moelora bench: {names} before --model-level: the layer suites' options. Fix: "
              "put the model-level run's options after --model-level (its --json too)",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    from ..bench import model_level

    model_level.main(args.model_level)
    return EXIT_OK
