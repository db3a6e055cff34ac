"""`moelora serve MODEL_DIR`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the
decode engine, one adapter per request (the request's `model` names it), continuous batching.

Flags carry vLLM's names; vLLM flags with no meaning here are refused with the reason
(vllm_serve_flags.py). The port is bound and the oracle's verdict printed before the weights
load. SIGTERM (or Ctrl-C) stops accepting, lets running rows finish for --shutdown-timeout
seconds, cancels what is left and exits 0. docs/serve.md has the rest.
"""

from __future__ import annotations

import argparse

from ..serve.model_dir import DecodeRunner
from .flag_terms import VLLM_LORA_FLAGS
from .flag_types import float_in, int_at_least, port, positive_int
from .vllm_serve_flags import add_refused

# The engine's words for what the user set with serve's flags (errors print the flags).
SERVE_FLAGS = VLLM_LORA_FLAGS | {
    "max_rows": "--max-num-seqs",
    "max_len": "--max-model-len",
    "max_new_tokens": "max_tokens",
    "num_blocks": "--num-gpu-blocks-override",
    "block_size": "--block-size",
}


seconds = float_in(0.0, 1e6, False, "a number of seconds in [0, 1e6]")
fraction = float_in(0.0, 1.0, True, "a fraction in (0, 1]")
model_len = int_at_least(2)

# vLLM's --load-format values served here, and why each other one is not
LOAD_FORMATS = ("auto", "safetensors", "dummy")
NOT_LOADED = {
    "pt": "auto reads a PyTorch .bin checkpoint when the directory has no .safetensors",
    "npcache": "no numpy weight cache is kept",
    "tensorizer": "tensorizer files are not read",
    "sharded_state": "one process reads the whole checkpoint; no per-rank shards",
    "gguf": "GGUF checkpoints are not read",
    "bitsandbytes": "bitsandbytes quantization is not served (FP8 experts: docs/fp8.md)",
    "mistral": "Mistral's consolidated format is not read; use the transformers checkpoint",
    "runai_streamer": "weights are read from the local directory only",
    "runai_streamer_sharded": "weights are read from the local directory only",
    "fastsafetensors": "weights are read with transformers (auto or safetensors)",
}


def load_format(value: str) -> str:
    """--load-format: auto, safetensors or dummy; vLLM's other formats refused with why."""
    if value in LOAD_FORMATS:
        return value
    why = NOT_LOADED.get(value, "not a load format vLLM or moelora knows")
    raise argparse.ArgumentTypeError(f"{value!r}: {why}; expected one of {', '.join(LOAD_FORMATS)}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server: /v1/completions, /v1/chat/completions, one PEFT "
        "adapter per request (model = adapter name), continuous batching",
    )
    p.add_argument("model", metavar="MODEL_DIR", help="a transformers model directory "
                   "(config.json, weights, tokenizer)")  # fmt: skip
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--served-model-name", default=None,
                   help="the base model's name in requests (default: MODEL_DIR as given)")  # fmt: skip
    p.add_argument("--enable-runtime-lora", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")  # fmt: skip
    p.add_argument("--allowed-local-lora-path", default=None, metavar="DIR",
                   help="runtime loads read only directories under DIR (a relative lora_path "
                   "is taken from DIR; default: any directory the server can read)")  # fmt: skip
    p.add_argument("--lora-resolver-dir", default=None, metavar="DIR",
                   help="a request naming an adapter the server does not know loads DIR/<name> "
                   "(confined to DIR; its base_model_name_or_path must be the served model)")  # fmt: skip
    p.add_argument("--chat-template", default=None,
                   help="the chat template: a file, or the Jinja template itself (default: "
                   "the tokenizer's)")  # fmt: skip
    p.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                   help="seconds running requests may finish after SIGTERM (default 30)")  # fmt: skip
    p.add_argument("--stall-dump-seconds", type=seconds, default=300.0, metavar="S",
                   help="log every thread's stack, once per stall, when a request has been "
                   "in flight longer than S seconds (default 300; 0: off)")  # fmt: skip
    p.add_argument("--ray-replicas", type=positive_int, default=None, metavar="N",
                   help="N engines behind Ray Serve (one GPU each when there are GPUs), "
                   "requests routed by adapter (the ray extra; docs/serve.md)")  # fmt: skip
    p.set_defaults(run=run)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags `serve` and `run-batch` share (vLLM's names)."""
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR",
                   help="PEFT adapter directories loaded at start: NAME=DIR, or vLLM's JSON "
                   '\'{"name": NAME, "path": DIR, "base_model_name": BASE}\'')  # fmt: skip
    p.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM's command lines: LoRA is always on here")  # fmt: skip
    p.add_argument(
        "--max-loras", type=positive_int, default=4, help="adapter slots on the device (default 4)"
    )
    p.add_argument("--max-lora-rank", type=positive_int, default=16,
                   help="largest LoRA rank (default 16)")  # fmt: skip
    p.add_argument("--max-cpu-loras", type=positive_int, default=None,
                   help="adapters kept parsed in host memory; the others are re-read from "
                   "their directory when a request needs them (default: --max-loras)")  # fmt: skip
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=64, help="rows decoding at once (default 64)"
    )
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="prompt tokens one engine step prefills at most (default: 8192 for "
                   "serve, `vllm serve`'s on a GPU of 70 GiB or more; 16384 for run-batch); on "
                   "the decode runner a longer prompt is prefilled in chunks over several "
                   "steps, beside the running rows' decodes")  # fmt: skip
    p.add_argument("--long-prefill-token-threshold", type=int_at_least(0), default=0,
                   help="on the decode runner, the most tokens of one prompt a step prefills "
                   "(0, the default: what --max-num-batched-tokens leaves), so a long prompt "
                   "lengthens the running rows' steps by at most that many tokens' work")  # fmt: skip
    p.add_argument("--adapter-preemption", action="store_true",
                   help="when a request has waited 3 s for an adapter slot and every slot is "
                   "held, suspend the running requests of one held adapter so that it gets the "
                   "slot (they resume by recompute with the output they would have given): "
                   "bounds the wait for the first token with more adapters in flight than "
                   "--max-loras, at the price of a pause in those streams; needs the decode "
                   "runner's paged cache (default off)")  # fmt: skip
    p.add_argument("--enable-chunked-prefill", action="store_true",
                   help="accepted for vLLM's command lines: chunked prefill is always on where "
                   "the decode runner runs (--max-num-batched-tokens sizes the chunks)")  # fmt: skip
    p.add_argument("--max-model-len", type=model_len, default=None,
                   help="longest prompt + output (default: the model's max positions)")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                   help="size the KV cache to fill this fraction of the GPU's memory after "
                   "weights, adapter banks and the longest prefill's activations: blocks on "
                   "the decode runner, else rows (at most --max-num-seqs); GPU only")  # fmt: skip
    add_cache_flags(p)
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the generator requests without a seed sample from")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU, fp32 on a CPU), bf16, "
                   "fp16 or fp32")  # fmt: skip
    p.add_argument("--moe-backend", default="auto", help="auto or a backend name")
    p.add_argument("--load-format", type=load_format, default="auto",
                   help="auto or safetensors: the directory's weights; dummy: random weights "
                   "of the config's shapes built on the device (benchmarks, smoke tests)")  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    add_refused(p)
    p.set_defaults(flag_terms=SERVE_FLAGS)  # errors name --max-loras, not num_slots


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    """Where decode steps run and the paged KV cache the decode runner keeps (vLLM's names)."""
    p.add_argument("--decode-runner", choices=[r.value for r in DecodeRunner], default="auto",
                   help="auto: moelora's decode runner (paged KV cache) on a CUDA GPU when it "
                   "knows the model's family, else transformers' forward (one KV slab per "
                   "row); on: the runner wherever the model runs (a model it does not know is "
                   "refused with why); off: transformers' forward (default auto)")  # fmt: skip
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="positions per KV-cache block on the decode runner (default 16)")  # fmt: skip
    p.add_argument("--num-gpu-blocks-override", type=positive_int, default=None, metavar="N",
                   help="KV-cache blocks on the decode runner, whatever "
                   "--gpu-memory-utilization sizes (default: --max-num-seqs requests of "
                   "--max-model-len, or that sizing)")  # fmt: skip
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="a prompt whose leading full blocks a request of the same adapter "
                   "version computed reads them from the cache (decode runner; default "
                   "on)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.ray_replicas is not None:
        from ..serve.ray import run as on_ray

        return on_ray(args)
    from ..serve.launch import run as launch

    return launch(args)
