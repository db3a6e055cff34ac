"""What a prompt chunk beside running decodes costs (GPU): the engine's unified step on a model
of Qwen3-30B-A3B's layer shapes (random bf16), the runner and the paged cache as `moelora
serve` runs them.

`rows` requests decode (their prompts in, adapters mixed or none); then, step after step, one
new request of N prompt tokens (random, no prefix hit, 1 output token: it ends in the step
that prefills it) joins the running rows' decodes. For each N: the step's wall time, and one
such step under the torch profiler (kernels, their busy GPU time and span: wall - span is the
host's share: Python, launches, sampling, copies). Beside it the decode-only step (a CUDA
graph replay) of the same rows. So `mixed(N) - decode` is what the chunk costs the running
rows, and at small N it is the cost of running the step eagerly (the decode graph is not
used when a chunk rides along).

    python -m benchmarks.mixed_step --layers 16 --json $OUT/mixed_step.json
    python -m benchmarks.mixed_step --device cpu   # a dry run on tiny shapes (no timing)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from .decode_profile import SHAPE, TINY, sync, timeline


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rows", type=int, default=64, help="running rows decoding beside the chunk")
    p.add_argument("--chunks", default="16,64,256,1024,4096,8192", help="prompt tokens N")
    p.add_argument("--prompt", type=int, default=256, help="the running rows' prompt length")
    p.add_argument("--adapters", type=int, default=8, help="0: LoRA-free rows")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="timed mixed steps per N")
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="also cProfile one step with an N-token chunk (the host's share)",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cpu: tiny shapes, eager, a dry run")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
        args.rows, args.chunks, args.prompt, args.adapters, args.rank, args.steps = (
            3, "4,9", 8, 2, 4, 1)  # fmt: skip
    return args


def build(args):
    import tempfile

    from moelora.hf import attach, toy

    cpu = args.device == "cpu"
    longest = max(int(n) for n in args.chunks.split(","))
    model = toy.build_model("qwen3_moe", seed=0, dtype=torch.float32 if cpu else torch.bfloat16,
                            device=args.device, num_hidden_layers=args.layers,
                            max_position_embeddings=max(longest, args.prompt) + 256,
                            **(TINY if cpu else SHAPE))  # fmt: skip
    tmp = Path(tempfile.mkdtemp())
    fused = toy.expert_parameters(model)
    names = []
    for k in range(args.adapters):  # half with q/k/v/o LoRA, as issue 36's mix
        extra = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]} if k % 2 else {}
        toy.write_peft_adapter(model, tmp / f"a{k}", seed=k + 1, r=args.rank,
                               lora_alpha=2 * args.rank, target_parameters=fused, **extra)  # fmt: skip
        names.append(f"a{k}")
    handle = attach(model, num_slots=max(1, args.adapters), max_rank=args.rank,
                    moe_backend="reference" if cpu else "auto")  # fmt: skip
    for n in names:
        handle.load_adapter(tmp / n, name=n)
    return model, handle, names


def main(argv=None) -> None:
    args = parse(argv)
    from moelora.engine import Engine, Request, Sampling  # after parse: TRITON_INTERPRET

    model, handle, names = build(args)
    chunks = [int(n) for n in args.chunks.split(",")]
    longest = max(chunks)
    cuda = args.device == "cuda"
    engine = Engine(handle, max_rows=args.rows + 2, max_len=max(longest, args.prompt) + 128,
                    max_num_batched_tokens=max(longest, args.rows) + args.rows,
                    enable_prefix_caching=False, enforce_eager=not cuda, runner=True)  # fmt: skip
    if engine.runner is None:
        raise SystemExit("mixed_step: the runner does not run this model")
    if cuda:
        engine.warmup()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n):
        return tuple(torch.randint(1, vocab, (n,), generator=gen).tolist())

    long = Sampling(max_new_tokens=engine.max_len - args.prompt, ignore_eos=True)
    for i in range(args.rows):
        adapter = names[i % len(names)] if names else None
        engine.add(Request(f"r{i}", prompt(args.prompt), adapter, long))
    engine.step()  # their prompts in
    for _ in range(3):
        engine.step()

    def timed(step_fn, steps):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step_fn()
        sync()
        return 1e3 * (time.perf_counter() - start) / steps

    decode_ms = timed(engine.step, 2 * args.steps)
    rows_out = [dict(chunk=0, step_ms=decode_ms, **(timeline(engine.step) if cuda else {}))]
    _print(rows_out[-1], args)
    count = 0

    def mixed(n):
        nonlocal count

        def once():
            nonlocal count
            adapter = names[count % len(names)] if names else None
            engine.add(Request(f"p{count}", prompt(n), adapter, Sampling(max_new_tokens=1)))
            count += 1
            errors = [e.error for e in engine.step() if e.error is not None]
            if errors:
                raise RuntimeError(f"mixed_step: a request failed: {errors[0]!r}")

        return once

    for n in chunks:
        step = mixed(n)
        for _ in range(2):  # warm at this shape (compiles, allocator)
            step()
        ms = timed(step, args.steps)
        rows_out.append(dict(chunk=n, step_ms=ms, **(timeline(step) if cuda else {})))
        _print(rows_out[-1], args)
    if args.host_profile:
        _host_profile(mixed(args.host_profile))
    engine.close()
    about = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                 layers=args.layers, rows=args.rows, prompt=args.prompt,
                 adapters=args.adapters)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(dict(about=about, rows=rows_out), indent=2))


def _host_profile(step) -> None:
    """Where one step's host time goes: cProfile's functions by own time and by total."""
    import cProfile
    import io
    import pstats

    step()  # warm at this shape
    prof = cProfile.Profile()
    prof.enable()
    step()
    sync()
    prof.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(30)
        print(out.getvalue(), flush=True)


def _print(row: dict, args) -> None:
    label = "decode only (graph)" if row["chunk"] == 0 else f"decode + {row['chunk']:5d} prompt"
    line = f"{args.rows} rows, {label}: {row['step_ms']:8.2f} ms"
    if "busy_us" in row:
        line += (f"; {row['kernels']} kernels busy {row['busy_us'] / 1e3:.2f} ms, span "
                 f"{row['span_us'] / 1e3:.2f} ms")  # fmt: skip
    print(line, flush=True)


if __name__ == "__main__":
    main()
