"""Model-level benchmark: a whole transformers MoE model decoding with many adapters.

One process, one model of Qwen3-30B-A3B's shape (random experts; `--layers` defaults to the
full 48), the configurations users compare, alternated and warm at every timed shape:

- `hf_eager`: transformers' own generate, LoRA-free, its grouped_mm experts;
- `hf_static` (with --hf-static): the same with `cache_implementation="static"`, which
  transformers compiles on a GPU (minutes per shape: its first call is reported apart);
- `moelora_free`: `handle.generate`, every row on the base model (no adapter);
- `moelora_experts`: `handle.generate`, --adapters expert-only adapters mixed in the batch
  (row i uses adapter i % adapters);
- `moelora_attention`: the same count of adapters, --attention-adapters of them also with
  q/k/v/o LoRA.

Before anything is timed, one mixed batch (every adapter, then a base row) is checked row by
row against HF + PEFT generating that row alone (truth/hf_peft.py; PEFT wraps the model in
place and is unloaded before moelora attaches: no second copy): the equal leading tokens of
the first --check-new. Per (configuration, batch): time to first token (a generate of one new
token: the prefill plus one sample), prefill tokens/s, decode tokens/s (the tokens a row
decodes between a generate of --new / 4 tokens and one of --new, over their time difference),
every generate on prompts of its own (no prefix-cache hit), peak memory,
and the decode step's memory floor: the bytes one decode step reads (every non-expert
weight, the LM head, the experts a batch of that size touches under uniform routing, the KV
cache) over the copy bandwidth measured in the same run, as decode tokens/s / floor tokens/s.
Startup is reported once: attach and adapter loads, the memory they take, and
`handle.warmup` (the decode engine for the largest batch built and every graph bucket
captured), their sum the startup a user waits for, and the kernel variants Triton compiled
meanwhile (new entries of its on-disk cache: none on a restart with the cache kept). Each
phase's wall time is reported too.

    moelora bench --model-level --layers 4 --batches 1,16,64 --json out/model.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import tempfile
import time
from pathlib import Path

import torch

from .qwen3_model import SMALL, Shape, build_model, full_depth, step_bytes, write_adapter

CONFIGS = ("hf_eager", "hf_static", "moelora_free", "moelora_experts", "moelora_attention")


class Clock:
    """Wall time and peak memory on the run's device (a CPU: the process's max RSS)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, call, *args) -> float:
        self.sync()
        start = time.perf_counter()
        call(*args)
        self.sync()
        return time.perf_counter() - start

    def time_and_peak(self, call, *args) -> tuple[float, float]:
        """`time`, and the peak memory in GiB: the device's during the call, or on a CPU the
        process's max RSS so far."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        seconds = self.time(call, *args)
        if self.cuda:
            return seconds, round(torch.cuda.max_memory_allocated() / 2**30, 3)
        import resource

        return seconds, round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def add_run_args(p: argparse.ArgumentParser, layers: int, prompt: int = 128) -> None:
    """The options the model-level generate benchmarks share (this one,
    benchmarks/fp8_generate.py)."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt", type=int, default=prompt)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed passes per configuration")
    p.add_argument("--check-new", type=int, default=8, help="tokens checked per row")
    p.add_argument("--json", default=None)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moelora bench --model-level",
                                description=__doc__.splitlines()[0])  # fmt: skip
    add_run_args(p, layers=full_depth(), prompt=256)
    p.add_argument("--attention-adapters", type=int, default=4)
    p.add_argument("--hf-static", action="store_true", help="add transformers' compiled path")
    p.add_argument("--configs", default=None, help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a tiny shape (CPU tests)")
    a = p.parse_args(argv)
    if a.new < 3:  # the decode rate needs a short generate between 1 and --new tokens
        p.error(f"--new {a.new}: at least 3 (decode is timed between {_short(3)} and --new tokens)")
    unknown = sorted(set(_configs(a)) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown {unknown}; expected some of {list(CONFIGS)}")
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse(argv)
    rows: list[dict] = []

    def emit(**r) -> None:
        rows.append(r)
        print(json.dumps(r), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))

    clock = Clock(a.device)
    dtype = torch.bfloat16 if clock.cuda else torch.float32
    shape = Shape(a.layers, **(SMALL if a.small else {}))
    _stamp(emit, a, clock.cuda)
    bandwidth = _bandwidth() if clock.cuda else None
    t0 = time.perf_counter()
    model = build_model(shape, a.device, dtype)
    emit(kind="model", layers=shape.layers, build_s=round(time.perf_counter() - t0, 2),
         params_gib=round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 3))  # fmt: skip
    configs = _configs(a)
    handle, adapter_sets = None, {}
    phase = _Phases(emit, clock)
    if any(c.startswith("moelora") for c in configs):
        dirs = phase("write_adapters", _write_adapters, a, shape)
        check = _CheckBatch(a, shape, dirs)
        phase("hf_peft_truth", check.truth, model)
        handle, adapter_sets = _attach(a, model, dirs, emit, clock)
        emit(**phase("check", check.against, handle))
    calls = {c: _call_for(c, model, handle, adapter_sets, a.prompt + a.new) for c in configs}
    gen = torch.Generator().manual_seed(1)
    for b in (int(b) for b in a.batches.split(",")):

        def prompts(b=b):
            return torch.randint(1, shape.vocab, (b, a.prompt), generator=gen).to(a.device)

        floor = None
        if bandwidth:
            floor = b / (step_bytes(model, shape, b, a.prompt + a.new // 2) / bandwidth)
        phase(f"batch_{b}", _measure_batch, a, calls, prompts, floor, emit, clock)
    memory = memory_bound(rows)
    if memory is not None:
        emit(**memory)
    return rows


def memory_bound(rows: list[dict]) -> dict | None:
    """Issue 36's memory bound: each moelora configuration's peak over its batches against
    the weights + the adapter banks (what attach and the loads took) + the KV cache (None
    where the startup has no device figure: a CPU run)."""
    model = next(r for r in rows if r["kind"] == "model")
    start = next((r for r in rows if r["kind"] == "startup"), None)
    if start is None or start["attach_gib"] is None:
        return None
    bound = model["params_gib"] + start["attach_gib"] + start["kv_gib"]
    peaks: dict[str, float] = {}
    for r in rows:
        if r["kind"] == "decode" and r["config"].startswith("moelora"):
            peaks[r["config"]] = max(peaks.get(r["config"], 0.0), r["peak_gib"])
    return dict(kind="memory", weights_banks_kv_gib=round(bound, 3), peak_gib=peaks,
                of_bound={c: round(p / bound, 3) for c, p in peaks.items()})  # fmt: skip


class _Phases:
    """Runs one phase of the benchmark and reports its wall time (where a device call's
    minutes go: the full-depth run has to fit one)."""

    def __init__(self, emit, clock: Clock) -> None:
        self.emit, self.clock = emit, clock

    def __call__(self, name: str, call, *args):
        start = time.perf_counter()
        out = call(*args)
        self.clock.sync()
        self.emit(kind="phase", phase=name, s=round(time.perf_counter() - start, 2))
        return out


def _measure_batch(a, calls: dict, prompts, floor: float | None, emit, clock: Clock) -> None:
    """Warm every configuration at this batch's shapes (graphs captured, compiles done), then
    time them alternately: a one-token generate (time to first token), a short one and a
    --new one. Decode tokens/s = the tokens between the short and the long generate over
    their time difference: both run the same prefill and decode path. (Against a one-token
    generate, which decodes nothing, the difference read 3672 tokens/s for rows with
    attention LoRA beside 3216 LoRA-free at batch 64, 48 layers: an order no decode step
    explains.) Every generate gets fresh prompts (prompts() draws a batch): the engine's
    prefix cache would otherwise skip the prefill of a prompt it kept from an earlier call
    (a 56 ms "time to first token" at batch 64 beside 260 ms, 2026-12-05)."""
    b, short = prompts().shape[0], _short(a.new)
    for c, call in calls.items():
        first = clock.time(call, prompts(), 1)
        clock.time(call, prompts(), short)
        clock.time(call, prompts(), a.new)
        if c == "hf_static":
            emit(kind="compile", config=c, batch=b, first_call_s=round(first, 1))
    times = {c: ([], [], []) for c in calls}
    peaks: dict[str, list] = {c: [] for c in calls}
    for rep in range(a.repeats):
        for c in list(calls) if rep % 2 == 0 else list(calls)[::-1]:
            for i, n in enumerate((1, short, a.new)):
                seconds, peak = clock.time_and_peak(calls[c], prompts(), n)
                times[c][i].append(seconds)
                peaks[c].append(peak)
    for c in calls:
        peak = max(peaks[c])
        ttft, part, total = (min(t) for t in times[c])
        decode = b * (a.new - short) / max(total - part, 1e-9)
        emit(kind="decode", config=c, batch=b, ttft_ms=round(ttft * 1e3, 2),
             prefill_tok_s=round(b * a.prompt / ttft, 1), decode_tok_s=round(decode, 1),
             floor_tok_s=None if floor is None else round(floor, 1),
             of_floor=None if floor is None else round(decode / floor, 3), peak_gib=peak)  # fmt: skip


def _short(new: int) -> int:
    """The short generate's tokens: a quarter of --new, at least 2 (one decode step)."""
    return max(2, new // 4)


def _stamp(emit, a: argparse.Namespace, cuda: bool) -> None:
    import transformers as tf

    from .runner import commit

    emit(kind="versions", torch=torch.__version__, transformers=tf.__version__, commit=commit(),
         device=torch.cuda.get_device_name() if cuda else "cpu", date=time.strftime("%Y-%m-%d"),
         args=vars(a))  # fmt: skip


def _bandwidth() -> float:
    from .floors import measure_ceilings

    return measure_ceilings().bandwidth


def _configs(a: argparse.Namespace) -> list[str]:
    wanted = a.configs.split(",") if a.configs else [c for c in CONFIGS if c != "hf_static"]
    if a.hf_static and "hf_static" not in wanted:
        wanted.insert(1, "hf_static")
    return wanted


def _write_adapters(a, shape: Shape) -> dict[str, Path]:
    """--adapters expert-only adapters e0.. and --attention-adapters with q/k/v/o too, q0.."""
    root = Path(tempfile.mkdtemp(prefix="moelora-bench-"))
    dirs = {}
    for k in range(a.adapters):
        dirs[f"e{k}"] = write_adapter(
            root / f"e{k}", shape, a.rank, False, seed=10 + k, device=a.device
        )
    for k in range(a.attention_adapters):
        dirs[f"q{k}"] = write_adapter(
            root / f"q{k}", shape, a.rank, True, seed=100 + k, device=a.device
        )
    return dirs


class _CheckBatch:
    """One mixed batch (every adapter, then a base row) of 32-token prompts: HF + PEFT
    generates each row alone first (`truth`, before moelora attaches), moelora the whole
    batch after (`against`)."""

    PROMPT = 32

    def __init__(self, a, shape: Shape, dirs: dict[str, Path]) -> None:
        self.new, self.dirs, self.names = a.check_new, dirs, [*dirs, None]
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(1, shape.vocab, (len(self.names), self.PROMPT), generator=gen)
        self.ids, self.want = ids.to(a.device), []

    def _generate(self, model, **kw):
        with torch.no_grad():
            return model.generate(max_new_tokens=self.new, min_new_tokens=self.new,
                                  do_sample=False, pad_token_id=0, **kw)  # fmt: skip

    def truth(self, model) -> None:
        from ..truth.hf_peft import peft_truth

        if self.new <= 0 or not self.dirs:
            return
        truth_of = peft_truth(model, self.dirs)
        for row, name in enumerate(self.names):
            out = self._generate(truth_of(name), input_ids=self.ids[[row]])
            self.want.append(out[0, self.PROMPT :])
        truth_of(self.names[0]).unload()  # the model as it was: moelora attaches to it

    def against(self, handle) -> dict:
        if not self.want:
            return dict(kind="check", rows=0, skipped="--check-new 0 or no adapters")
        out = self._generate(handle, input_ids=self.ids, adapter_names=self.names)
        equal = [
            int((out[r, self.PROMPT :] == w).cumprod(0).sum()) for r, w in enumerate(self.want)
        ]
        return dict(kind="check", rows=len(self.names), adapters=self.names,
                    equal_prefix_tokens=equal, of=self.new)  # fmt: skip


def _attach(a, model, dirs: dict[str, Path], emit, clock: Clock):
    """Attach, load the adapters, warm up; report the startup."""
    from ..hf import attach

    before = torch.cuda.memory_allocated() if clock.cuda else None
    compiled = _triton_entries()
    loaded = time.perf_counter()
    handle = attach(model, num_slots=len(dirs), max_rank=a.rank)
    for name, path in dirs.items():
        handle.load_adapter(path, name=name)
    clock.sync()
    loaded = time.perf_counter() - loaded
    taken = None if before is None else (torch.cuda.memory_allocated() - before) / 2**30
    largest = max(int(b) for b in a.batches.split(","))
    warm_s = clock.time(handle.warmup, largest, a.prompt + a.new)
    compiled = len(_triton_entries() - compiled)
    from ..engine.generate import thread_engine

    kv = thread_engine(handle).cache.nbytes() / 2**30
    emit(kind="startup", backend=handle.backend_name, attach_and_load_s=round(loaded, 2),
         attach_gib=None if taken is None else round(taken, 3), warmup_s=round(warm_s, 2),
         startup_s=round(loaded + warm_s, 2), kv_gib=round(kv, 3), adapters=sorted(dirs),
         triton_compiled=compiled)  # fmt: skip
    expert_only = [f"e{k}" for k in range(a.adapters)]
    attention = [f"q{k}" for k in range(a.attention_adapters)]
    # attention adapters first, interleaved: batch 1 runs one, every batch holds both kinds
    rest = expert_only[: a.adapters - len(attention)]
    mixed = [n for pair in zip(attention, rest) for n in pair] + attention[len(rest) :]
    mixed += rest[len(attention) :]
    sets = {"moelora_free": [None], "moelora_experts": expert_only, "moelora_attention": mixed}
    return handle, sets


def _triton_entries() -> set[str]:
    """The entries of Triton's on-disk kernel cache (one a compiled kernel variant; a variant
    found there is loaded, not compiled): the startup row counts those its warmup added."""
    from triton import knobs

    root = Path(knobs.cache.dir)
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def _call_for(config: str, model, handle, sets: dict, cache_len: int):
    """The generate call of one configuration. hf_static gets a StaticCache of one length
    (prompt + --new) for every generate: transformers sizes the static cache it makes to each
    call's max length, and each length recompiles (the 1 / short / --new generates cost three
    compiles a batch, ~177 s of the 48-layer run at batch 1)."""
    kw = dict(do_sample=False, pad_token_id=0)

    def hf(ids, new, **extra):
        if handle is not None:
            model.set_experts_implementation("grouped_mm")
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new,
                                  **kw, **extra)  # fmt: skip

    if config == "hf_eager":
        return hf
    if config == "hf_static":
        from transformers import StaticCache

        # transformers' name for it, as the engine reads it (`past_key_values` before 5.2x)
        params = inspect.signature(model.forward).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"

        def static(ids, new):
            cache = StaticCache(config=model.config, max_cache_len=cache_len)
            return hf(ids, new, **{cache_kw: cache})

        return static
    names = sets[config]

    def ml(ids, new):
        model.set_experts_implementation("moelora")
        rows = [names[i % len(names)] for i in range(ids.shape[0])]
        return handle.generate(ids, adapter_names=rows, max_new_tokens=new, min_new_tokens=new,
                               **kw)  # fmt: skip

    return ml


if __name__ == "__main__":
    main()
