"""Parallel layouts timed on every rank of one machine (issue 16): tensor parallel with and
without fully sharded LoRA, expert parallel and EP x TP of model-shaped layers, each output
checked against the single-process result, timed against it, and set beside `moelora plan`'s
verdict for the same deployment.

Run from the repository root, one process per GPU (NCCL):
    torchrun --standalone --nproc-per-node 2 scripts/parallel_bench.py \
        [--models qwen3-30b-a3b,deepseek-v3] [--tokens 1,64,1024,16384] [--json PATH]
and on CPUs over gloo (triton interpreted), tiny shapes, as tests/test_parallel_bench.py does:
    torchrun --standalone --nproc-per-node 2 scripts/parallel_bench.py --device cpu \
        --models tiny --dtype float32 --tokens 5 --rank 4 --fs-ranks 8 --adapters 3

Layouts of a world of N ranks, most wanted first, each add_inputs mode of --modes:
  tp{N}-r{R}, fs-tp{N}-r{R}   TP without / with fully sharded LoRA, at each R of --rank,
                              --fs-ranks and R = N (R / tp == 1)
  ep{N}-r{rank}               expert parallel
  ep{e}xtp{t}, fs-ep{e}xtp{t} every e * t = N with e, t > 1, at --rank
Each deployment comes from `moelora plan`'s own flags (`plan_cmd` in the JSON) through the plan
machinery, and the layer runs that very deployment: the oracle picks its backend (--backend
is a request, honoured or refused, never a direct pick). The plan's verdict is recorded beside
what ran; `plan_agrees` is false where they differ (moelora plan accepted it but it was
refused, failed or differed from the single process; or the other way round).

Each (layout, T): rank 0's output against the single-process result (the same backend on the
full weights on rank 0's GPU, moelora.compare's tolerance for the dtype; that result against
the fp32 reference at T <= --ref-tokens), then (benchmarks/rank_clock.py: CUDA events, calls
queued behind a spin so the launch cost is hidden; the median of --iters after --warmup calls
at the timed shapes; the slowest rank's median):
  layer_ms        the whole ParallelMoELoRALayer forward (layer_eager_ms: without the spin)
  collective_ms   the collectives that forward issued, replayed alone on buffers of their
                  sizes (benchmarks/collective_seams.py): the output all-reduce, and under
                  fully sharded LoRA the shrink's all-gather and all-reduce
  compute_ms      the layer without collectives: the comm's replaced by local copies of the
                  same shapes, the output all-reduce skipped (same kernels, same shapes)
  single_ms       the single-process layer, the same way; speedup = single_ms / layer_ms
`fs_pays`: fully sharded against the same layout without it (same rank, mode and T).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import os
import sys
import time
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():  # triton runs interpreted on CPUs (set before moelora loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.collective_seams import describe, recording, replay, without_collectives
from benchmarks.parallel_report import agreement, fs_pays, summary, table, verdict_line
from benchmarks.rank_clock import Clock, agree, slowest
from moelora.bench.runner import dump, stamp
from moelora.cli import build_parser
from moelora.commands import plan as plan_command
from moelora.commands.cpu_cost import parallel_bench_cost
from moelora.compare import compare, poison_
from moelora.config import AddInputs, parse_dtype
from moelora.errors import MoeloraError
from moelora.inputs import build_experts, build_inputs, build_lora
from moelora.layer import MoELoRALayer
from moelora.parallel import ParallelMoELoRALayer
from moelora.presets import resolve_model
from moelora.reference import moe_lora_reference

BROADCAST_CHUNK = 1 << 26  # elements per broadcast: bounded messages for GBs of weights


@dataclass(frozen=True)
class Layout:
    """One parallel layout of a LoRA layer of rank `rank`: tp x ep ranks."""

    tp: int
    ep: int
    fully_sharded: bool
    rank: int
    add_inputs: AddInputs

    @property
    def id(self) -> str:
        split = {
            (True, True): f"ep{self.ep}xtp{self.tp}",
            (True, False): f"tp{self.tp}",
            (False, True): f"ep{self.ep}",
            (False, False): "single",
        }[(self.tp > 1, self.ep > 1)]
        fs = "fs-" if self.fully_sharded else ""
        return f"{fs}{split}-r{self.rank}-{self.add_inputs.value}"

    @property
    def single(self) -> Layout:
        return Layout(1, 1, False, self.rank, self.add_inputs)

    def fields(self) -> dict:
        return dict(
            tp=self.tp,
            ep=self.ep,
            fully_sharded=self.fully_sharded,
            rank=self.rank,
            add_inputs=self.add_inputs.value,
        )


def layouts(world: int, rank: int, fs_ranks: list[int], modes: list[AddInputs]) -> list[Layout]:
    """Every layout of `world` ranks (module docstring), most wanted first."""
    out = []
    for r in dict.fromkeys([rank, *fs_ranks, world]):
        for fully_sharded in (False, True):
            out += [Layout(world, 1, fully_sharded, r, m) for m in modes]
        if r == rank:
            out += [Layout(1, world, False, r, m) for m in modes]
    for ep in (e for e in range(2, world // 2 + 1) if world % e == 0):
        for fully_sharded in (False, True):
            out += [Layout(world // ep, ep, fully_sharded, rank, m) for m in modes]
    return out


def plan_argv(model: str, layout: Layout, args: argparse.Namespace) -> list[str]:
    """`moelora plan`'s flags for the deployment a layout runs (eager, as it is timed)."""
    argv = ["plan", "--model", model, "-tp", str(layout.tp), "-ep", str(layout.ep)]
    argv += ["--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank"]
    argv += [str(layout.rank), "--lora-add-inputs", layout.add_inputs.value, "--dtype"]
    argv += [args.dtype, "--moe-backend", args.backend, "--enforce-eager"]
    return argv + (["--fully-sharded-loras"] if layout.fully_sharded else [])


def plan(argv: list[str]):
    """(the deployment or None, the plan's verdict) for `moelora <argv>`, computed as
    commands/plan/'s run computes them (its parser, build_deployment, notes, resolve)."""
    args = build_parser().parse_args(argv)
    try:
        deployment = plan_command.build_deployment(args)
        doc = plan_command.resolve(deployment, args.device, plan_command.notes(args, deployment))
    except MoeloraError as err:  # a configuration `moelora plan` exits 2 on
        return None, dict(accepted=False, selected=None, verdict=f"ERROR: {err}", warnings=[])
    keep = ("accepted", "selected", "verdict", "warnings", "notes", "fix")
    return deployment, {k: doc[k] for k in keep if k in doc}


def built(make, deployment):
    """make(deployment), or the reason it was not built (a str)."""
    if deployment is None:
        return "no deployment: moelora plan's flags were refused as a configuration error"
    try:
        return make(deployment)
    except MoeloraError as err:  # the oracle's refusal, or a layout the world cannot hold
        return f"{type(err).__name__}: {err}"


def same_on_every_rank(*tensors: torch.Tensor | None) -> None:
    """Rank 0's values everywhere, in place (the seeded builders agree already; this makes
    it certain)."""
    for t in tensors:
        if t is not None:
            for piece in t.view(-1).split(BROADCAST_CHUNK):
                dist.broadcast(piece, src=0)


class ModelBench:
    """One model's full weights, banks (by rank) and inputs (by T), equal on every rank.
    Building a bank or a batch is collective: every rank asks for the same, in order."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device) -> None:
        model = resolve_model(name)
        shape = dataclasses.replace(model.shape, dtype=parse_dtype(args.dtype))
        self.name, self.model, self.device = name, dataclasses.replace(model, shape=shape), device
        self.adapters, self.banks, self.batches, self.refs = args.adapters, {}, {}, {}
        self.experts = build_experts(self.model, device.type)
        same_on_every_rank(*_tensors(self.experts))

    def bank(self, rank: int):
        if rank not in self.banks:
            torch.manual_seed(rank)
            self.banks[rank] = build_lora(self.model, self.adapters, rank, self.device.type)
            same_on_every_rank(*_tensors(self.banks[rank]))
        return self.banks[rank]

    def batch(self, tokens: int):
        """x [T, H], topk_ids, topk_weights, token_slots (token t on slot t % L, as moelora
        bench and the vLLM peer assign them), prior [T, H] (what add mode adds to)."""
        if tokens not in self.batches:
            x, ids, wts, _ = build_inputs(self.model, tokens, self.adapters, self.device.type, 0)
            slots = (torch.arange(tokens, device=x.device) % self.adapters).to(torch.int32)
            prior = torch.randn_like(x)
            same_on_every_rank(x, ids, wts, slots, prior)
            self.batches[tokens] = (x, ids, wts, slots, prior)
        return self.batches[tokens]

    def reference(self, rank: int, tokens: int) -> torch.Tensor:
        """The fp32 reference of the full layer at T (no prior added), once per (rank, T)."""
        if (rank, tokens) not in self.refs:
            x, ids, wts, slots, _ = self.batch(tokens)
            woi = self.model.routing.method.weights_on_input
            self.refs[(rank, tokens)] = moe_lora_reference(
                x, ids, wts, slots, self.experts, self.bank(rank), self.model.shape,
                weights_on_input=woi,
            )  # fmt: skip
        return self.refs[(rank, tokens)]


def _tensors(weights) -> list[torch.Tensor | None]:
    """The tensor fields themselves (dataclasses.astuple would deep-copy GBs of weights);
    None for an absent one, host-side fields (a bank's tile_rank) left out."""
    values = [getattr(weights, f.name) for f in dataclasses.fields(weights)]
    return [v for v in values if v is None or isinstance(v, torch.Tensor)]


def output_buffer(prior: torch.Tensor, mode: AddInputs) -> torch.Tensor:
    return prior.clone() if mode is AddInputs.ADD else poison_(torch.empty_like(prior))


def single_results(bench: ModelBench, needed: list[Layout], clock: Clock, args, say):
    """((rank, mode, T) -> the single-process output and times, or None where the
    single-process deployment is refused), and their JSON rows. say: rank 0's progress."""
    results, rows = {}, []
    for layout in needed:
        argv = plan_argv(bench.name, layout, args)
        deployment, verdict = plan(argv)
        layer = built(lambda d: MoELoRALayer(d, bench.experts, check_values=False), deployment)
        row = dict(model=bench.name, layout=layout.id, **layout.fields())
        row |= dict(plan_cmd="moelora " + " ".join(argv), plan=verdict)
        row["error"] = layer if isinstance(layer, str) else None
        for tokens in args.tokens:
            key = (layout.rank, layout.add_inputs, tokens)
            if row["error"]:
                results[key] = None
                continue
            results[key] = single_point(layer, bench, layout, tokens, clock, args)
            times = {k: v for k, v in results[key].items() if k != "y"}
            say(f"{bench.name} single process {layout.single.id} T={tokens}: {times['ms']:.3g} ms")
            rows.append(row | dict(T=tokens, backend=layer.backend_name, **times))
        if row["error"]:
            rows.append(row)
    return results, rows


def single_point(layer: MoELoRALayer, bench: ModelBench, layout: Layout, tokens: int, clock, args):
    """The single-process output at T (against the reference at small T), and its times."""
    x, ids, wts, slots, prior = bench.batch(tokens)
    bank, mode, shape = bench.bank(layout.rank), layout.add_inputs, bench.model.shape
    out = output_buffer(prior, mode)

    def call():
        layer(x, ids, wts, slots, bank, out=out, add_inputs=mode)

    call()
    row = dict(y=out.clone(), vs_reference=None)
    if tokens <= args.ref_tokens:
        ref = bench.reference(layout.rank, tokens)
        ref = ref + prior if mode is AddInputs.ADD else ref
        row["vs_reference"] = _cmp(compare(row["y"], ref, shape.dtype))
    row["ms"], row["host_bound"] = clock.median(call)
    row["eager_ms"], _ = clock.median(call, spin=False)
    return row


def _cmp(c) -> dict:
    return dict(ok=c.ok, rel_err=c.rel_err, max_abs=c.max_abs, tol=c.tol)


def run_point(layer, bench: ModelBench, layout: Layout, tokens: int, bank, single, clock):
    """One (layout, T) on every rank: the checked call, then the timings (rank 0's row)."""
    device = bench.device
    x, ids, wts, slots, prior = bench.batch(tokens)
    out, mode = output_buffer(prior, layout.add_inputs), layout.add_inputs

    def call(view=layer):
        view(x, ids, wts, slots, bank, out=out, add_inputs=mode)

    log: list = []
    call(recording(layer, log))  # the checked call; the collectives it issues are logged
    row = dict(model=bench.name, layout=layout.id, T=tokens, **layout.fields())
    if dist.get_rank() == 0:
        row |= _cmp(compare(out, single["y"], bench.model.shape.dtype)) if single else {}
        row.setdefault("ok", False)  # no single-process result: nothing to be equal to
        row["single_vs_reference"] = single["vs_reference"] if single else None
    row["layer_ms"], row["layer_host_bound"] = slowest(clock.median(call, barrier=True), device)
    row["layer_eager_ms"], _ = slowest(clock.median(call, spin=False, barrier=True), device)
    quiet = without_collectives(layer)
    timing = clock.median(lambda: call(quiet), barrier=True)
    row["compute_ms"], row["compute_host_bound"] = slowest(timing, device)
    timing = clock.median(replay(layer, log, device), barrier=True)
    row["collective_ms"], row["collective_host_bound"] = slowest(timing, device)
    row |= describe(log)
    if single:
        row |= dict(single_ms=single["ms"], single_eager_ms=single["eager_ms"])
        row["speedup"] = single["ms"] / row["layer_ms"]
        row["speedup_eager"] = single["eager_ms"] / row["layer_eager_ms"]
    return row


def run_layout(bench: ModelBench, layout: Layout, singles: dict, clock: Clock, args):
    """Every T of one layout on every rank -> (its record, its rows; rank 0's are complete)."""
    argv = plan_argv(bench.name, layout, args)
    deployment, verdict = plan(argv)
    record = dict(model=bench.name, layout=layout.id, **layout.fields())
    record |= dict(plan_cmd="moelora " + " ".join(argv), plan=verdict, failed=None)
    make = lambda d: ParallelMoELoRALayer(d, bench.experts, check_values=False)  # noqa: E731
    layer = built(make, deployment)
    record["ran"] = not isinstance(layer, str)
    record["error"] = layer if isinstance(layer, str) else None
    rows = []
    if record["ran"]:
        record["backend"] = layer.layer.backend_name
        record["I_p"] = deployment.intermediate_per_partition
        record["E_l"] = deployment.local_experts
        # A failure the same on every rank (a kernel that does not compile, an out-of-memory
        # at the same shape) brings every rank to the except at the same point: recorded, and
        # the next layout runs. One rank failing alone leaves the others in a collective until
        # the group's timeout (--timeout-s) ends the run; the JSON written so far stays.
        try:
            bank = layer.shard_bank(bench.bank(layout.rank))
            for tokens in args.tokens:
                single = singles.get((layout.rank, layout.add_inputs, tokens))
                rows.append(run_point(layer, bench, layout, tokens, bank, single, clock))
        except Exception as err:
            record["failed"] = f"{type(err).__name__}: {str(err)[:500]}"
            if dist.get_rank() == 0:
                print(f"{bench.name} {layout.id}: FAILED: {record['failed']}", file=sys.stderr)
        del layer
    record |= agreement(record, rows)
    return record, rows


def skipped(bench: ModelBench, layout: Layout, args) -> dict:
    """A layout left out by the time budget, its plan verdict still recorded."""
    argv = plan_argv(bench.name, layout, args)
    record = dict(model=bench.name, layout=layout.id, **layout.fields())
    return record | dict(
        plan_cmd="moelora " + " ".join(argv),
        plan=plan(argv)[1],
        skipped=True,
        ran=False,
        error=None,
        failed=None,
        checks_passed=None,
        plan_agrees=None,
        disagreement=None,
    )


METHOD = dict(
    layer="the whole ParallelMoELoRALayer forward",
    collective="the collectives one forward issued (logged at the checked call), replayed "
    "alone through the layer's own seams on zero buffers of the same shapes and dtypes",
    compute="the layer without collectives: the LoRA comm replaced by local copies of the same "
    "shapes, the output all-reduce skipped (the same kernels on the same shapes)",
    gpu="CUDA events around each call, the calls queued behind a spin kernel (the host's "
    "launch cost hidden); the median of --iters after --warmup; the slowest rank's median",
    eager="the same calls without the spin (the host's launch cost in, where it dominates)",
    cpu="wall time of each call, the median",
    single="the same backend on the full weights on rank 0's device (MoELoRALayer, tp = ep = "
    "1, the same add_inputs mode); checked against the fp32 reference at T <= --ref-tokens",
    plan="moelora plan's parser, build_deployment, notes and resolve in-process (as "
    "commands/plan/'s run) on the flags in plan_cmd; the layer runs that very deployment",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    names = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    modes = lambda s: [AddInputs(m) for m in names(s)]  # noqa: E731
    add = p.add_argument
    add(
        "--models",
        type=names,
        default=names("qwen3-30b-a3b,deepseek-v3"),
        help="presets or config.json paths, comma separated",
    )
    add("--tokens", type=ints, default=ints("1,64,1024,16384"), help="T values, comma separated")
    add("--adapters", type=int, default=8, help="adapter slots L (token t on slot t %% L)")
    add("--rank", type=int, default=16, help="the LoRA rank of every layout")
    add(
        "--fs-ranks",
        type=ints,
        default=ints("64"),
        help="more ranks for TP with and without fully sharded LoRA (R = world always added)",
    )
    add("--modes", type=modes, default=modes("overwrite,add"), help="add_inputs modes")
    add("--dtype", default="bfloat16")
    add("--backend", default="triton", help="--moe-backend as moelora plan takes it (or auto)")
    add(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: NCCL, one GPU per process; cpu: gloo",
    )
    add("--iters", type=int, default=20, help="timed calls per timing")
    add("--warmup", type=int, default=3, help="calls before each timing, at the timed shape")
    add(
        "--ref-tokens",
        type=int,
        default=64,
        help="check the single-process result against the fp32 reference at T <= this",
    )
    add(
        "--budget-s",
        type=float,
        default=450.0,
        help="wall-clock budget, shared by the models in order (unused time carries on); "
        "layouts past it are skipped, their plan verdict still recorded",
    )
    add(
        "--timeout-s",
        type=float,
        default=300.0,
        help="the process group's collective timeout (a rank left alone in one)",
    )
    add(
        "--layouts",
        type=names,
        default=["*"],
        help="layout ids to run, fnmatch patterns, comma separated (e.g. 'fs-*,tp*-r16-*')",
    )
    add("--json", default=None, help="write the results here (rank 0; rewritten per layout)")
    return p.parse_args(argv)


def init(args: argparse.Namespace) -> torch.device:
    """This process's rank in the group torchrun describes (RANK, WORLD_SIZE, MASTER_*)."""
    if "RANK" not in os.environ:
        raise SystemExit(
            "parallel_bench: no RANK in the environment; launch one process per rank with "
            "torchrun --standalone --nproc-per-node N scripts/parallel_bench.py ..."
        )
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: one thread per rank keeps the ranks apart
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return device


def header(args: argparse.Namespace, device: torch.device) -> dict:
    out = stamp(None) | dict(world=dist.get_world_size(), dist_backend=dist.get_backend())
    if device.type == "cuda":
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        out["gpus"] = torch.cuda.device_count()
    settings = vars(args) | dict(modes=[m.value for m in args.modes])
    return out | dict(settings=settings, method=METHOD, singles=[], layouts=[], rows=[])


def run(args: argparse.Namespace, device: torch.device) -> int:
    world, rank0 = dist.get_world_size(), dist.get_rank() == 0
    if world < 2:
        raise SystemExit("parallel_bench: needs 2 or more ranks (--nproc-per-node 2 or more)")
    todo = [
        layout
        for layout in layouts(world, args.rank, args.fs_ranks, args.modes)
        if any(fnmatch.fnmatch(layout.id, pattern) for pattern in args.layouts)
    ]
    clock, payload = Clock(device, args.iters, args.warmup), header(args, device)
    start = time.perf_counter()
    say = _say(start, rank0)
    say(f"parallel_bench: {len(todo)} layouts of {world} ranks x T = {args.tokens} on "
        f"{', '.join(args.models)} ({device.type}, {dist.get_backend()})")  # fmt: skip
    if rank0 and device.type == "cpu":
        _warn_cpu_cost(args, len(todo))
    for i, name in enumerate(args.models):
        deadline = start + args.budget_s * (i + 1) / len(args.models)
        say(f"{name}: building the full weights, banks and batches on every rank")
        bench = ModelBench(name, args, device)
        for rank in dict.fromkeys(layout.rank for layout in todo):
            bench.bank(rank)  # collective: every rank builds the same, in the same order
        for tokens in args.tokens:
            bench.batch(tokens)
        needed = list(dict.fromkeys(layout.single for layout in todo))
        # every rank computes the single-process results on its own GPU at once (rank 0's are
        # the ones used): no rank waits in a collective the whole while, past --timeout-s
        say(f"{name}: the single-process results ({len(needed)} deployments)")
        singles, single_rows = single_results(bench, needed, clock, args, say)
        payload["singles"] += single_rows
        say(f"{name}: {len(single_rows)} single-process rows")
        dist.barrier()
        for layout in todo:
            if agree(time.perf_counter() > deadline, device):
                record, rows = skipped(bench, layout, args), []
            else:
                record, rows = run_layout(bench, layout, singles, clock, args)
            payload["layouts"].append(record)
            payload["rows"] += rows
            if rank0:
                _progress(record, rows, time.perf_counter() - start)
                _write(payload, args, start)
        del bench, singles
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not rank0:
        return 0
    _write(payload, args, start)
    print(table(payload["rows"], payload["layouts"], payload["fs_pays"]))
    print(verdict_line(payload["summary"]))
    s = payload["summary"]
    return 0 if s["passed"] == s["rows"] and not s["plan_disagreements"] else 1


def _say(start: float, rank0: bool):
    """Rank 0's progress printer: each line stamped with the seconds since the start."""

    def say(text: str) -> None:
        if rank0:
            print(f"[{time.perf_counter() - start:5.0f} s] {text}", flush=True)

    return say


def _warn_cpu_cost(args: argparse.Namespace, layouts: int) -> None:
    """On CPUs, before any weight is built: the estimate, when it is more than seconds."""
    calls = 1 + 4 * (args.warmup + args.iters)  # check, layer with/without spin, compute
    total = None
    for name in args.models:
        cost = parallel_bench_cost(resolve_model(name), args.tokens, 2 * layouts, calls)
        total = cost if total is None else total + cost
    if total is not None and total.large:
        print(
            f"parallel_bench: warning: --models {','.join(args.models)} --tokens "
            f"{','.join(map(str, args.tokens))} on CPUs (gloo, Triton interpreted) takes "
            f"{total.describe()} (estimate, moelora/commands/cpu_cost.py; --budget-s "
            f"{args.budget_s:.0f} skips the layouts past it, not the single-process runs). "
            "Fix: --models tiny --dtype float32 --tokens 5 --rank 4 --fs-ranks 8 --adapters 3 "
            "--iters 2 --warmup 1 "
            "runs in seconds; run on GPUs for the real sizes",
            file=sys.stderr,
            flush=True,
        )


def _write(payload: dict, args: argparse.Namespace, start: float) -> None:
    payload["fs_pays"] = fs_pays(payload["rows"])
    payload["summary"] = summary(payload["rows"], payload["layouts"], time.perf_counter() - start)
    if args.json:
        dump(args.json, payload)


def _progress(record: dict, rows: list[dict], elapsed: float) -> None:
    state = "skipped" if record.get("skipped") else "built" if record["ran"] else "not built"
    state = "FAILED" if record.get("failed") else state
    checks = f"{sum(bool(r['ok']) for r in rows)}/{len(rows)} equal" if rows else ""
    agrees = {True: "plan agrees", False: "PLAN DISAGREES", None: ""}[record["plan_agrees"]]
    print(
        f"[{elapsed:5.0f} s] {record['model']} {record['layout']}: {state} {checks} {agrees}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = init(args)
    try:
        code = run(args, device)
        dist.barrier()  # every rank done before any tears the group down
    finally:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    status = main()
    # Leave without the interpreter's teardown: with gloo, a rank's exit after the group was
    # destroyed still aborted now and then on a loaded 2-core machine ("terminate called
    # without an active exception", SIGABRT, after every row had printed and passed; 1 of
    # 3 full test runs). Everything is written and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
