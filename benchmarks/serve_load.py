"""Load generator for `moelora serve` (H200): Poisson arrivals at concurrency 1 / 16 / 64,
prompts of --prompt tokens, outputs of --new tokens (ignore_eos), requests naming adapters
drawn from 8 and from 32 (--max-loras 8 slots), beside the same server's LoRA-free requests.
Reports output tokens/s, time to first token p50/p99 and inter-token latency p50/p99 per
(scenario, concurrency), and each LoRA scenario's throughput over the LoRA-free one.

It writes a model directory of Qwen3-30B-A3B's shape (the preset, full depth unless
--layers; config.json and a word-level tokenizer: "w0 .. wV") and --adapters distinct
random PEFT adapter directories of --rank on the routed experts (PEFT's own file layout,
written directly: a PEFT wrap of a 30 B model would copy it). It then starts the server
as a child process: `moelora serve`'s own run() (engine, scheduler, FastAPI app, uvicorn
on 127.0.0.1), with random bf16 weights built on the GPU instead of read from disk (61 GB
of random weights would not fit the machine's disk; the weights' values do not change the
work). 32 adapter names are served from the written directories (name i from directory
i % --adapters), each a separate adapter to the server; the host cache holds them all
(--max-cpu-loras), so a slot miss costs a host-to-device copy. Clients stream (SSE) from
this process with httpx2; each row is printed and saved (--json) as it ends; the server is
stopped by SIGTERM at the end (also when this process gets one, e.g. from `timeout`).

    python -m benchmarks.serve_load --json $OUT/serve_load.json
The HF + PEFT baseline (adapters one at a time) is ../shared/peer/hf_peft_generate.py.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# Qwen3-30B-A3B's attention and vocabulary (its public config.json) beside the preset's MoE keys
QWEN3_30B_REST = dict(
    vocab_size=151936, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # fmt: skip


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48, help="decoder layers (default 48: full)")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--scenarios", default="base,8,32",
                   help="base (LoRA-free) and adapter counts drawn from")  # fmt: skip
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default max(8, 4 x concurrency))")  # fmt: skip
    p.add_argument("--rate", type=float, default=32.0,
                   help="Poisson arrival rate, requests/s (default 32)")  # fmt: skip
    p.add_argument("--adapters", type=int, default=8, help="distinct adapter directories")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="the server's host cache of parsed adapters (default: every adapter "
                   "name: a slot miss is then a host-to-device copy, not a file read)")  # fmt: skip
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--work", default=None, help="directory for the model and adapters")
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true",
                   help="a tiny model on the CPU (fp32): a smoke run of this script, no GPU")  # fmt: skip
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the server process
    return p.parse_args(argv)


# --tiny: the width of moelora.hf.toy's qwen3_moe, a vocabulary the word tokenizer spans fast
TINY = dict(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
            intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=512, max_position_embeddings=512)  # fmt: skip


def model_config(layers: int, tiny: bool = False) -> dict:
    from moelora.presets import PRESETS

    preset = {k: v for k, v in PRESETS["qwen3-30b-a3b"].items() if k != "torch_dtype"}
    return {**preset, **QWEN3_30B_REST, "num_hidden_layers": layers, **(TINY if tiny else {})}


def write_model_dir(root: Path, config: dict) -> None:
    """config.json and a word-level tokenizer "w0 .. wV-1" (no weights)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    root.mkdir(parents=True, exist_ok=True)
    transformers.AutoConfig.for_model(**config).save_pretrained(root)
    # no special token: every generated token decodes to one word (the clients count words)
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core)
    tok.save_pretrained(root)


def write_expert_adapter(root: Path, config: dict, rank: int, seed: int) -> None:
    """A PEFT target_parameters adapter on every layer's fused experts, in the file layout
    PEFT's save_pretrained writes (tests/test_serve_loadgen.py checks it against PEFT):
    gate_up (wrapped first: base_layer) A [E*r, H], B [2I, r*E]; down A [E*r, I], B [H, r*E]."""
    from safetensors.torch import save_file

    E, H = config["num_experts"], config["hidden_size"]
    I = config["moe_intermediate_size"]  # noqa: E741
    device = "cuda" if torch.cuda.is_available() else "cpu"  # 1.3 GB of randn: fast there
    gen = torch.Generator(device).manual_seed(seed)

    def factor(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        key = f"base_model.model.model.layers.{layer}.mlp.experts"
        for prefix, (a_in, b_out) in ((f"{key}.base_layer", (H, 2 * I)), (key, (I, H))):
            tensors[f"{prefix}.lora_A.weight"] = factor(E * rank, a_in)
            tensors[f"{prefix}.lora_B.weight"] = factor(b_out, rank * E)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, root / "adapter_model.safetensors")
    adapter_config = dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
        target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        bias="none", use_rslora=False, fan_in_fan_out=False, base_model_name_or_path=None,
    )  # fmt: skip
    (root / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


def serve_child(args: argparse.Namespace) -> int:
    """The server process: random bf16 weights on the GPU, then `moelora serve`'s run()."""
    import transformers

    from moelora.cli import build_parser
    from moelora.serve.launch import run

    argv = json.loads(args.child)
    serve_args = build_parser().parse_args(["serve", *argv])
    config = transformers.AutoConfig.from_pretrained(serve_args.model)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):  # the CPU: --tiny smoke runs only
        dtype = torch.bfloat16 if cuda else torch.float32
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # non-zero experts (from_config may leave them at zero)
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, p.shape[-1] ** -0.5)
    return run(serve_args, model=model.eval())


def start_server(args: argparse.Namespace, work: Path, names: list[str]) -> subprocess.Popen:
    argv = [str(work / "model"), "--served-model-name", "base", "--port", str(args.port),
            "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.rank),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(args.prompt + args.new + 16),
            "--max-cpu-loras", str(args.max_cpu_loras),
            "--lora-modules",
            *[f"{n}={work / f'adapter{i % args.adapters}'}" for i, n in enumerate(names)]]  # fmt: skip
    cmd = [sys.executable, "-m", "benchmarks.serve_load", "--child", json.dumps(argv)]
    return subprocess.Popen(cmd)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900.0) -> None:
    import httpx2 as httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server was not ready after {timeout_s} s")


async def one(client, url: str, body: dict) -> dict:
    """One streamed request: TTFT, the gaps between tokens, tokens received, latency."""
    start = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as got:
        if got.status_code != 200:
            raise RuntimeError(f"HTTP {got.status_code}: {await got.aread()}")
        async for line in got.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = json.loads(line[6:])["choices"][0]["text"]
                times.extend([time.perf_counter()] * len(text.split()))  # one word per token
    if not times:
        raise RuntimeError(f"no token streamed for {body['model']}")
    return {"ttft": times[0] - start, "itl": [b - a for a, b in itertools.pairwise(times)],
            "tokens": len(times), "latency": time.perf_counter() - start}  # fmt: skip


async def level(url: str, names: list[str | None], concurrency: int, count: int, args, rng):
    """`count` requests arriving as a Poisson process (rate args.rate), at most
    `concurrency` in flight; adapters drawn uniformly from `names` (None: base)."""
    import httpx2 as httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def request(delay: float):
            await asyncio.sleep(delay)
            async with gate:
                prompt = [rng.randrange(1, args.vocab) for _ in range(args.prompt)]
                body = {"model": rng.choice(names) or "base", "prompt": prompt,
                        "max_tokens": args.new, "temperature": 0, "ignore_eos": True,
                        "stream": True}  # fmt: skip
                return await one(client, url, body)

        arrivals, t = [], 0.0
        for _ in range(count):
            arrivals.append(t)
            t += rng.expovariate(args.rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(request(a) for a in arrivals))
        elapsed = time.perf_counter() - start
    return summary(results, elapsed)


async def warm(url: str, names: list[str | None], args) -> None:
    """One short request per adapter of `names`, so a pool that fits the slots is loaded
    before its level is timed (the previous level may have left other adapters there)."""
    import httpx2 as httpx

    async with httpx.AsyncClient(timeout=600) as client:
        for name in names:
            body = {"model": name or "base", "prompt": [1, 2, 3], "max_tokens": 2,
                    "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
            await one(client, url, body)


def summary(results: list[dict], elapsed: float) -> dict:
    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else float("nan")

    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "output_tokens": tokens, "seconds": elapsed,
            "output_tok_s": tokens / elapsed, "ttft_p50_ms": pct(ttft, 0.5),
            "ttft_p99_ms": pct(ttft, 0.99), "itl_p50_ms": pct(itl, 0.5),
            "itl_p99_ms": pct(itl, 0.99)}  # fmt: skip


def stamp() -> dict:
    import transformers

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "commit": commit.strip()}  # fmt: skip


def prepare(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The model directory and adapter directories written; the adapter names served."""
    work = Path(args.work or tempfile.mkdtemp(prefix="serve_load_"))
    config = model_config(args.layers, args.tiny)
    write_model_dir(work / "model", config)
    for i in range(args.adapters):
        write_expert_adapter(work / f"adapter{i}", config, args.rank, seed=i + 1)
    args.vocab = config["vocab_size"]
    most = max([int(s) for s in args.scenarios.split(",") if s != "base"] or [0])
    args.max_cpu_loras = args.max_cpu_loras or max(most, args.max_loras)
    return work, [f"lora{i}" for i in range(most)]


def measure(args: argparse.Namespace, url: str, names: list[str], rows: list[dict]) -> None:
    """Every (concurrency, scenario) level, appended to `rows` (and saved) as it ends."""
    rng = random.Random(0)
    asyncio.run(level(url, [None, *names[:8]], 8, 16, args, rng))  # warm-up: slots, allocator
    # every name read from its directory once (a running server's host cache): a level's
    # slot misses are then host-to-device copies, not file reads
    asyncio.run(warm(url, names, args))
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        count = args.requests or max(8, 4 * concurrency)
        base = None
        for scenario in args.scenarios.split(","):
            pool = [None] if scenario == "base" else names[: int(scenario)]
            if len(pool) <= args.max_loras:  # steady state: a pool that fits is in the slots
                asyncio.run(warm(url, pool, args))
            row = {"scenario": scenario, "concurrency": concurrency,
                   **asyncio.run(level(url, pool, concurrency, count, args, rng))}  # fmt: skip
            base = row["output_tok_s"] if scenario == "base" else base
            row["vs_lora_free"] = row["output_tok_s"] / base if base else None
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(args, rows, None)


def save(args: argparse.Namespace, rows: list[dict], server_exit_code: int | None) -> None:
    if not args.json:
        return
    kept = {k: v for k, v in vars(args).items() if k not in ("child", "vocab")}
    doc = {"stamp": stamp(), "args": kept, "rows": rows, "server_exit_code": server_exit_code}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2))


def table(rows: list[dict]) -> None:
    print(f"\n{'scenario':>9} {'conc':>5} {'tok/s':>9} {'vs base':>8} {'TTFT p50':>9} "
          f"{'p99':>8} {'ITL p50':>8} {'p99':>7}  (ms)")  # fmt: skip
    for r in rows:
        ratio = f"{r['vs_lora_free']:.2f}x" if r["vs_lora_free"] else "-"
        print(f"{r['scenario']:>9} {r['concurrency']:>5} {r['output_tok_s']:>9.0f} {ratio:>8} "
              f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>8.1f} {r['itl_p50_ms']:>8.2f} "
              f"{r['itl_p99_ms']:>7.2f}")  # fmt: skip


def main() -> None:
    args = parse()
    if args.child is not None:
        sys.exit(serve_child(args))
    # a SIGTERM to this process (e.g. `timeout`) still stops the server and saves the rows
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = time.perf_counter()
    work, names = prepare(args)
    print(f"serve_load: model and {args.adapters} adapters written to {work} in "
          f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    proc = start_server(args, work, names)
    url, rows, code = f"http://127.0.0.1:{args.port}", [], None
    try:
        wait_ready(url, proc)
        print(f"serve_load: server ready after {time.perf_counter() - start:.0f} s", flush=True)
        measure(args, url, names, rows)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        table(rows)
        print(f"server exit code after SIGTERM: {code}")
        save(args, rows, code)


if __name__ == "__main__":
    main()
