"""The load benchmark users run against `moelora serve`: random prompt and output lengths,
adapters drawn with Zipf-like popularity from more names than slots, a long prompt arriving
while streams run, and LoRA-free requests on the same arrivals, all in one call.

It writes a model directory of Qwen3-30B-A3B's shape (config.json and a word tokenizer, no
weights; --layers deep, or --tiny for a CPU) and --adapters random PEFT adapter directories
(benchmarks/serve_load_model.py), then starts a real `moelora serve` process on them with
`--load-format dummy` (random weights of the config's shapes built on the device: the
weights' values do not change the work). --adapter-names names are served from those
directories (name i from directory i % --adapters), each a separate adapter to the server,
over --max-loras slots; the host cache holds every name, so a slot miss is a host-to-device
copy.

Each concurrency level draws its arrivals once (benchmarks/serve_workload.py: Poisson
arrivals at --rate, lengths from --prompt-len / --output-len, adapter names by --zipf) and
runs them twice, LoRA-free (the base model's name) and with adapters. Requests go through
the official `openai` client (async, streaming, ignore_eos, no retries, --request-timeout),
at most `concurrency` in flight; a request that raises, times out or streams fewer tokens
than asked is counted failed, with its error. The long-prompt scenario starts
--long-streams streams, and once each has streamed tokens sends one --long-prompt-token
prompt: the streams' inter-token latency before it is sent against while it waits for its
first token. Adapter copies into slots are read from the server's /metrics
(moelora_adapter_slot_loads_total) before and after each run, and so are preemptions and the
prefix-cache hit rate (vLLM's vllm:num_preemptions_total, vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total), each with the reason when it is 0 by construction or not
applicable (the server's KV cache, as its startup line says, is in the JSON). --decode-runner,
--long-prefill-token-threshold, --block-size, --num-gpu-blocks-override,
--[no-]enable-prefix-caching and --adapter-preemption are passed to the server when given. Output: a table on stdout
(rows as BENCHMARKS.md cites them) and --json.

    python -m benchmarks.serve_load --json $OUT/serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import serve_load_model as model_dir
from benchmarks import serve_load_report as report
from benchmarks.serve_workload import Lengths, Workload, arrivals


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--layers", type=int, default=48, help="decoder layers (default 48: full)")
    add("--tiny", action="store_true", help="a tiny model on the CPU (fp32): a smoke run")
    add("--concurrency", default="1,16,64", help="levels: requests in flight at most")
    add("--requests", type=int, default=0, help="per run (default max(8, 4 x concurrency))")
    add("--rate", type=float, default=32.0, help="Poisson arrival rate, requests/s")
    add("--prompt-len", default="uniform:128:1024",
        help="prompt tokens: fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA:MAX")  # fmt: skip
    add("--output-len", default="uniform:32:256", help="output tokens, the same forms")
    add("--seed", type=int, default=0, help="seeds every length, prompt, name and arrival")
    add("--adapter-names", type=int, default=32, help="adapter names served")
    add("--adapters", type=int, default=8, help="distinct adapter directories behind them")
    add("--zipf", type=float, default=1.0, help="popularity exponent (0: uniform)")
    add("--rank", type=int, default=16)
    add("--max-loras", type=int, default=8, help="the server's adapter slots")
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=None, help="passed to the server")
    add("--long-prefill-token-threshold", type=int, default=None, help="passed to the server")
    add("--gpu-memory-utilization", type=float, default=None, help="passed to the server")
    add("--adapter-preemption", action="store_true", help="passed to the server")
    add("--decode-runner", choices=("auto", "on", "off"), default=None,
        help="passed to the server (its default: auto)")  # fmt: skip
    add("--block-size", type=int, default=None, help="passed to the server (its default: 16)")
    add("--num-gpu-blocks-override", type=int, default=None, help="passed to the server")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="passed to the server (its default: on)")  # fmt: skip
    add("--long-prompt", type=int, default=16384, help="the long prompt's tokens (0: no run)")
    add("--long-streams", type=int, default=16, help="streams running when it arrives")
    add("--long-stream-tokens", type=int, default=512, help="each stream's output tokens")
    add("--request-timeout", type=float, default=600.0, help="seconds, each request")
    add("--port", type=int, default=0, help="the server's port (default: a free one)")
    add("--work", default=None, help="directory for the model, adapters and server log")
    add("--json", default=None)
    args = p.parse_args(argv)
    try:
        args.prompt_dist = Lengths.parse(args.prompt_len, "--prompt-len")
        args.output_dist = Lengths.parse(args.output_len, "--output-len")
    except ValueError as err:
        p.error(str(err))
    return args


STREAM_PROMPT = 64  # the long-prompt scenario's streams: short prompts, long outputs
LONG_OUTPUT = 4  # the long prompt's own output tokens (its prefill is what is measured)
WARM_TOKENS = 16  # tokens every stream has streamed before the long prompt is sent


def max_model_len(args) -> int:
    longest = args.prompt_dist.high + args.output_dist.high
    if args.long_prompt:
        longest = max(longest, args.long_prompt + LONG_OUTPUT,
                      STREAM_PROMPT + args.long_stream_tokens)  # fmt: skip
    return longest + 8


def prepare(args) -> tuple[Path, list[str]]:
    """The model and adapter directories written; the adapter names, most popular first."""
    work = Path(args.work or tempfile.mkdtemp(prefix="serve_load_"))
    config = model_dir.model_config(args.layers, args.tiny, positions=max_model_len(args))
    model_dir.write_model_dir(work / "model", config)
    for i in range(args.adapters):
        model_dir.write_expert_adapter(work / f"adapter{i}", config, args.rank, seed=i + 1)
    args.vocab = config["vocab_size"]
    return work, [f"lora{i}" for i in range(args.adapter_names)]


def server_argv(args, work: Path, names: list[str]) -> list[str]:
    argv = [str(work / "model"), "--load-format", "dummy", "--served-model-name", "base",
            "--host", "127.0.0.1", "--port", str(args.port),
            "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.rank),
            "--max-cpu-loras", str(len(names)), "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(max_model_len(args)),
            "--lora-modules", *[f"{n}={work / f'adapter{i % args.adapters}'}"
                                for i, n in enumerate(names)]]  # fmt: skip
    if args.gpu_memory_utilization is None and not args.tiny and cuda_available():
        # rows x --max-model-len of static KV slabs (16k for the long prompt) would not fit
        # beside 48 layers' weights at --max-num-seqs 64: the server sizes them to 0.9
        args.gpu_memory_utilization = 0.9
    for flag in ("max_num_batched_tokens", "long_prefill_token_threshold",
                 "gpu_memory_utilization", "decode_runner", "block_size",
                 "num_gpu_blocks_override"):  # fmt: skip
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if args.enable_prefix_caching
                    else "--no-enable-prefix-caching")  # fmt: skip
    if args.adapter_preemption:
        argv.append("--adapter-preemption")
    if args.tiny:
        argv += ["--dtype", "float32"]
    return argv


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list[str], log: Path) -> subprocess.Popen:
    """`moelora serve ...argv`, its output in `log`."""
    root = str(Path(__file__).resolve().parent.parent)  # this tree first, then the caller's
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = os.environ | {"PYTHONPATH": path}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "moelora", "serve", *argv],
                                stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as got:
        return got.read().decode()


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready; "
                             f"its log ({log}):\n{log.read_text()[-4000:]}")  # fmt: skip
        try:
            get(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server was not ready after {timeout_s} s (log: {log})")


def kv_cache_of(log: Path, args) -> dict:
    """The server's KV cache as its startup line says: paged (blocks of block_size
    positions, prefix caching on or off) or one slab of max_len positions per row (rows:
    --max-num-seqs, or what --gpu-memory-utilization left room for)."""
    text = log.read_text()
    paged = re.search(r"KV cache of (\d+) blocks x (\d+) positions .*prefix caching (on|off)",
                      text)  # fmt: skip
    if paged:
        return {"paged": True, "blocks": int(paged[1]), "block_size": int(paged[2]),
                "prefix_caching": paged[3] == "on"}  # fmt: skip
    slab = re.search(r"KV cache of (\d+) rows x (\d+) positions", text)
    rows, positions = (int(slab[1]), int(slab[2])) if slab else (args.max_num_seqs, None)
    return {"paged": False, "rows": rows, "positions": positions}


def startup_lines(log: Path) -> list[str]:
    """The server's own lines up to ready (`moelora serve: ...`: the cache it chose, decode
    graphs and prompt warm-up with their seconds), in order."""
    return [line for line in log.read_text().splitlines() if line.startswith("moelora serve: ")]


async def one(client, model: str, prompt, max_tokens: int, timeout: float, times=None) -> dict:
    """One streamed completion; `times` gets each token's arrival (perf_counter) as it comes.
    Any exception, the timeout, or fewer tokens than asked: a failure with its reason."""
    times = [] if times is None else times
    start, usage, error = time.perf_counter(), None, None
    try:
        async with asyncio.timeout(timeout):
            stream = await client.completions.create(
                model=model, prompt=list(prompt), max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                now = time.perf_counter()
                usage = chunk.usage.completion_tokens if chunk.usage else usage
                for choice in chunk.choices:  # one word per token (the word tokenizer)
                    times.extend([now] * len(choice.text.split()))
    except Exception as err:  # every failure is counted, with its type
        error = f"{type(err).__name__}: {str(err)[:200]}"
    tokens = usage if usage is not None else len(times)
    if error is None and (tokens != max_tokens or not times):
        error = f"short stream: {tokens} of {max_tokens} tokens ({len(times)} words)"
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"ok": error is None, "error": error, "tokens": len(times), "times": times,
            "ttft": times[0] - start if times else None, "itl": gaps}  # fmt: skip


def client_of(url: str, timeout: float):
    from openai import AsyncOpenAI

    # no retries: a retried request would hide its failure and its time
    return AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)


async def run_level(url, plan, concurrency: int, adapters: bool, args) -> dict:
    """The arrivals `plan`, at most `concurrency` in flight; adapter names or the base's."""
    gate = asyncio.Semaphore(concurrency)
    client = client_of(url, args.request_timeout)

    async def request(a):
        await asyncio.sleep(a.at)
        async with gate:
            model = a.adapter if adapters else "base"
            return await one(client, model, a.prompt, a.output, args.request_timeout)

    before = report.counters(get(url + "/metrics"))
    start = time.perf_counter()
    results = await asyncio.gather(*(request(a) for a in plan))
    elapsed = time.perf_counter() - start
    after = report.counters(get(url + "/metrics"))
    await client.close()
    used = len({a.adapter for a in plan}) if adapters else 0
    row = report.level_row(results, elapsed, before, after, args.kv_cache)
    return row | {"adapter_names_drawn": used}


async def run_long(url, names: list[str], adapters: bool, args, rng: random.Random) -> dict:
    """--long-streams streams; once each has WARM_TOKENS tokens, one --long-prompt prompt.
    The streams' gaps after all of them started and before it was sent, against those
    overlapping [sent, its first token]."""
    client = client_of(url, args.request_timeout)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, args.vocab) for _ in range(n)]

    live = [[] for _ in range(args.long_streams)]
    # with adapters: the streams' names fit the slots, so none waits for one
    fits = names[: max(1, min(len(names), args.max_loras))]
    model = (lambda i: fits[i % len(fits)]) if adapters else (lambda i: "base")
    tasks = [asyncio.create_task(one(client, model(i), prompt(STREAM_PROMPT),
             args.long_stream_tokens, args.request_timeout, live[i]))
             for i in range(args.long_streams)]  # fmt: skip
    deadline = time.monotonic() + args.request_timeout
    while (min(len(t) for t in live) < WARM_TOKENS and not all(t.done() for t in tasks)
           and time.monotonic() < deadline):  # fmt: skip
        await asyncio.sleep(0.005)
    sent = time.perf_counter()
    long = await one(client, model(0), prompt(args.long_prompt), LONG_OUTPUT,
                     args.request_timeout)  # fmt: skip
    first = sent + long["ttft"] if long["ttft"] is not None else time.perf_counter()
    streams = await asyncio.gather(*tasks)
    await client.close()
    started = max((s["times"][0] for s in streams if s["times"]), default=sent)
    pairs = [(a, b) for s in streams for a, b in itertools.pairwise(s["times"])]
    before = [b - a for a, b in pairs if a >= started and b <= sent]
    during = [b - a for a, b in pairs if b > sent and a < first]
    through = sum(1 for s in streams if s["times"] and s["times"][-1] > first)
    return report.long_row(streams, long, before, during, through) | {
        "streams": args.long_streams, "stream_tokens": args.long_stream_tokens,
        "long_prompt_tokens": args.long_prompt,
    }  # fmt: skip


async def measure(args, url: str, names: list[str], doc: dict) -> None:
    """Every level's two runs, then the long-prompt scenario's, saved as each ends."""
    client = client_of(url, args.request_timeout)
    warm = [
        await one(client, name, [1, 2, 3], 2, args.request_timeout) for name in ["base", *names]
    ]  # each name read from its directory once (host cache)
    await client.close()
    doc["warmup"] = report.outcome(warm)  # its failures counted too
    work = Workload(args.rate, args.prompt_dist, args.output_dist, tuple(names), args.zipf,
                    args.vocab)  # fmt: skip
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        rng = random.Random(args.seed * 1_000_003 + concurrency)
        plan = arrivals(work, args.requests or max(8, 4 * concurrency), rng)
        base = None
        for adapters in (False, True):
            row = {"run": "adapters" if adapters else "lora-free", "concurrency": concurrency,
                   **await run_level(url, plan, concurrency, adapters, args)}  # fmt: skip
            base = base or row["output_tok_s"]
            row["vs_lora_free"] = row["output_tok_s"] / base if base else None
            doc["levels"].append(row)
            print(json.dumps(row), flush=True)
            save(args, doc)
    for adapters in (False, True) if args.long_prompt else ():
        rng = random.Random(args.seed * 1_000_003 + 7)
        row = {"run": "adapters" if adapters else "lora-free",
               **await run_long(url, names, adapters, args, rng)}  # fmt: skip
        doc["long_prompt"].append(row)
        print(json.dumps(row), flush=True)
        save(args, doc)


def stamp() -> dict:
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "commit": commit.strip()}  # fmt: skip


def save(args, doc: dict) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))


def main() -> None:
    args = parse()
    # a SIGTERM to this process (e.g. `timeout`) still stops the server and saves the rows
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = time.perf_counter()
    work, names = prepare(args)
    args.port = args.port or free_port()
    argv, log = server_argv(args, work, names), work / "server.log"
    kept = {k: v for k, v in vars(args).items() if k not in ("prompt_dist", "output_dist")}
    doc = {"stamp": stamp(), "args": kept, "not_exported": report.NOT_EXPORTED,
           "server": {"command": ["moelora", "serve", *argv], "log": str(log)},
           "levels": [], "long_prompt": [], "complete": False}  # fmt: skip
    print(f"serve_load: model and {args.adapters} adapters in {work}; "
          f"moelora serve {' '.join(argv[:12])} ...", flush=True)  # fmt: skip
    proc = start_server(argv, log)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url, proc, log)
        doc["server"]["kv_cache"] = args.kv_cache = kv_cache_of(log, args)
        doc["server"]["startup"] = startup_lines(log)  # graphs, prompt warm-up, KV cache
        doc["server"]["ready_s"] = ready = round(time.perf_counter() - start, 1)
        print(f"serve_load: server ready after {ready:.0f} s", flush=True)
        asyncio.run(measure(args, url, names, doc))
        doc["complete"] = True
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            doc["server"]["exit_code"] = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            doc["server"]["exit_code"] = proc.wait()
        print(report.table(doc))
        save(args, doc)


if __name__ == "__main__":
    main()
