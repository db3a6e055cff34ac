"""`moelora validate`: every registered fast backend against the reference on real layer
shapes, in the serving dtype (bf16; `--dtype` for fp16 / fp32), on this machine's GPU.
Prints pass/fail per case.

Cases per model: T sweep (8 adapters, rank 16, eager), CUDA-graph replay with fresh inputs
copied into the captured buffers, ranks 8/16/64/128, 1 adapter, and the LoRA-free path.
Adapters alternate rank R and R/2 (zero-padded), and every (L+1)-th token has slot -1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from ..compare import compare
from ..config import AddInputs, DeviceFacts, LoRAConfig, ModelConfig
from ..deployment import Deployment
from ..device import probe
from ..inputs import build_experts, build_inputs, build_lora
from ..oracle import select
from ..presets import resolve_model
from ..reference import moe_lora_reference
from ..weights import ExpertWeights, LoRABank

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "nemotron-h", "gpt-oss-20b")
TOKENS = (1, 2, 7, 16, 64, 255, 1024, 4096, 16384)


@dataclass(frozen=True)
class Case:
    tokens: int
    adapters: int  # L; 0 = no LoRA bank (base path)
    rank: int
    graphs: bool

    def label(self) -> str:
        lora = f"L={self.adapters} R={self.rank}" if self.adapters else "no LoRA"
        return f"T={self.tokens} {lora} {'graph' if self.graphs else 'eager'}"


def sweep_cases(tokens: tuple[int, ...], rank: int = 16) -> list[Case]:
    """The T sweep (--quick runs only this): 8 adapters of rank `rank`, eager."""
    return [Case(t, 8, rank, False) for t in tokens]


def default_cases(tokens: tuple[int, ...] = TOKENS, rank: int = 16) -> list[Case]:
    cases = sweep_cases(tokens, rank)
    cases += [Case(t, 8, 16, True) for t in (1, 255, 4096) if t in tokens or len(tokens) > 3]
    cases += [Case(t, 8, r, False) for r in (8, 64, 128) for t in (64, 1024)]
    cases += [Case(t, 1, 16, False) for t in (7, 1024)]
    cases += [Case(16, 0, 16, False), Case(4096, 0, 16, True)]
    return cases


@dataclass
class Problem:
    model: ModelConfig
    experts: ExpertWeights
    lora: LoRABank | None
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    token_slots: torch.Tensor | None


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def with_dtype(model: ModelConfig, dtype: str | None) -> ModelConfig:
    """model in another dtype (`--dtype`), or as it is (None)."""
    if dtype is None:
        return model
    return dataclasses.replace(model, shape=dataclasses.replace(model.shape, dtype=DTYPES[dtype]))


def select_backend(name: str, model: ModelConfig, case: Case, device: DeviceFacts):
    """The backend `name` through the oracle, for exactly what this case runs: a backend the
    oracle would refuse for this deployment is never run (the refusal is the case's error)."""
    lora = LoRAConfig(
        enabled=case.adapters > 0,
        max_rank=case.rank,
        max_loras=max(1, case.adapters),
        add_inputs=AddInputs.OVERWRITE,  # forward without `out` writes y
    )
    deployment = Deployment.for_model(
        model, device=device, lora=lora, cuda_graphs=case.graphs, backend=name
    )
    oracle_log = logging.getLogger("moelora.oracle")
    level = oracle_log.level
    oracle_log.setLevel(logging.WARNING)  # one selection per case: keep the table readable
    try:
        return select(deployment).backend
    finally:
        oracle_log.setLevel(level)


def run_case(
    backend,
    model: ModelConfig,
    experts: ExpertWeights,
    case: Case,
    device: str,
    ref_tokens: int,
    seed: int,
) -> tuple[object, float]:
    """-> (Comparison on the first ref_tokens rows, seconds)."""
    start = time.perf_counter()
    lora = build_lora(model, case.adapters, case.rank, device)
    woi = model.routing.method.weights_on_input
    x, ids, w, slots = build_inputs(model, case.tokens, case.adapters, device, seed)

    def fwd(x, ids, w, slots):
        return backend.forward(x, ids, w, slots, experts, lora, model.shape, weights_on_input=woi)

    if case.graphs:
        out = _graph_run(
            fwd,
            (x, ids, w, slots),
            build_inputs(model, case.tokens, case.adapters, device, seed + 1),
        )
    else:
        out = fwd(x, ids, w, slots)
    n = min(case.tokens, ref_tokens)
    s = None if slots is None else slots[:n]
    ref = moe_lora_reference(
        x[:n], ids[:n], w[:n], s, experts, lora, model.shape, weights_on_input=woi
    )
    result = compare(out[:n], ref, model.shape.dtype)
    return result, time.perf_counter() - start


def _graph_run(fwd, capture_inputs, fresh_inputs):
    """Capture fwd on capture_inputs, copy fresh_inputs into those buffers, replay: a result
    that matches the reference of fresh_inputs proves nothing was baked in at capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            fwd(*capture_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fwd(*capture_inputs)
    for dst, src in zip(capture_inputs, fresh_inputs):
        if dst is not None:
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "validate",
        help="check fast backends against the reference on real layer shapes (this GPU; "
        "bf16 unless --dtype)",
    )
    p.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated presets or config.json paths"
    )
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--backends", default="triton", help="comma-separated registered backends")
    p.add_argument(
        "--ref-tokens",
        type=int,
        default=4096,
        help="compare the first N tokens' rows (reference cost grows with T)",
    )
    p.add_argument("--quick", action="store_true", help="T sweep only, eager")
    p.add_argument(
        "--rank",
        type=int,
        default=16,
        help="LoRA rank R of the T sweep (8 adapters alternating R and R/2); e.g. 128 for the "
        "largest shared-memory need",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="the activations' and weights' dtype (default: each model's, bf16 for the presets)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "validate: no CUDA device here (use --device cpu with TRITON_INTERPRET=1 and a tiny model)"
        )
        return 2
    tokens = tuple(int(t) for t in args.tokens.split(","))
    if args.rank < 1:
        print(f"validate: --rank {args.rank}: expected a LoRA rank >= 1")
        return 2
    cases = sweep_cases(tokens, args.rank) if args.quick else default_cases(tokens, args.rank)
    if args.device != "cuda":
        cases = [c for c in cases if not c.graphs]
    failures = total = 0
    print(
        f"{'backend':<9} {'model':<16} {'case':<34} {'rel_err':>9} {'max_abs':>9} {'tol':>6}  "
        f"result  s"
    )
    device = probe()
    for name in args.backends.split(","):
        for model_name in args.models.split(","):
            model = with_dtype(resolve_model(model_name), args.dtype)
            experts = build_experts(model, args.device, args.seed)
            for case in cases:
                total += 1
                try:
                    backend = select_backend(name, model, case, device)
                    res, secs = run_case(
                        backend, model, experts, case, args.device, args.ref_tokens, args.seed
                    )
                    line = (
                        f"{res.rel_err:9.2e} {res.max_abs:9.2e} {res.tol:6.0e}  "
                        f"{'pass' if res.ok else 'FAIL':<6} {secs:5.1f}"
                    )
                    failures += not res.ok
                except Exception as err:  # report and continue: the table is the product
                    failures += 1
                    msg = " ".join(str(err).split())  # refusals span lines
                    line = f"ERROR {type(err).__name__}: {msg[:160]}"
                print(f"{name:<9} {model_name:<16} {case.label():<34} {line}", flush=True)
            del experts
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(f"validate: {total - failures}/{total} passed" + ("" if not failures else " — FAILURES"))
    return 1 if failures else 0
