"""`moelora generate`: a transformers MoE model generating one mixed batch, each row with its
own PEFT adapter (or the base model), through moelora.hf.attach.

With no --model it builds a small random Qwen3-MoE model with transformers' own classes
(no download; larger and bf16 on a GPU), writes four random adapters with PEFT's own
save_pretrained (two PEFT layouts, ranks 1 to 8, one with attention LoRA), loads them and
generates a left-padded batch of five rows (four adapters and a base row). Each row is
checked against HF + PEFT generating that row alone with its adapter.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from ..compare import compare
from ..config import parse_dtype
from ..errors import ConfigError

DEFAULT_ROWS = ["fused-r8", "fused-r4-attn", None, "modules-r4", "fused-r2"]
# The GPU default: bigger than the CPU toy, still seconds to build (random weights).
GPU_TOY = dict(
    hidden_size=1024, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
    num_hidden_layers=4, vocab_size=4096, num_attention_heads=8, num_key_value_heads=2,
    head_dim=128, intermediate_size=2048,
)  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="a transformers MoE model generating a mixed-adapter batch (default: a random "
        "model and four PEFT adapters, each row checked against HF+PEFT alone)",
    )
    p.add_argument("--model", help="a local model directory (default: a random Qwen3-MoE)")
    p.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=DIR",
        help="a PEFT adapter directory to load under NAME (repeatable; with --model)",
    )  # fmt: skip
    p.add_argument(
        "--rows", help="comma-separated adapter name per row, 'base' for none "
        "(default: each adapter once, then a base row)",
    )  # fmt: skip
    p.add_argument("--prompt", action="append", default=[], help="a prompt (needs a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens to generate (default 8)")
    p.add_argument("--max-loras", type=int, default=None, help="adapter slots (default: enough)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="max LoRA rank (default 16)")
    p.add_argument("--moe-backend", default="auto", help="auto or a backend name")
    p.add_argument("--dtype", default="auto", help="auto (fp32: exact check) or bf16 / fp16")
    p.add_argument(
        "--no-check", action="store_true", help="skip the HF+PEFT row-by-row check"
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # transformers' own deprecation notes, raised when PEFT calls it: nothing a user acts on
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\.")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    cuda = torch.cuda.is_available()
    if not cuda:
        # No GPU: the Triton kernels run through Triton's interpreter (slow, exact).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ..hf import attach, toy

    device = "cuda" if cuda else "cpu"
    # fp32 by default, on a GPU too: both sides then compute exactly (IEEE fp32 dots), so the
    # check can demand equal tokens; in bf16 (--dtype bf16, what serving runs) rounding can
    # flip a near-tie and only the logits are held to the dtype's tolerance.
    dtype = torch.float32 if args.dtype == "auto" else parse_dtype(args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            if args.adapter:
                raise ConfigError(
                    "--adapter", args.adapter[0], "--model DIR with it", "name --model"
                )
            kwargs = GPU_TOY if cuda else {}
            base = toy.build_model(
                "qwen3_moe", seed=args.seed, dtype=dtype, device=device, **kwargs
            )
            count = sum(p.numel() for p in base.parameters())
            what = f"random Qwen3-MoE ({count / 1e6:.2f} M parameters, no download)"
            adapters, truths = {}, {}
            for i, (name, kw) in enumerate(toy.demo_adapters(base).items()):
                adapters[name] = Path(tmp) / name
                truths[name] = toy.write_peft_adapter(
                    base, adapters[name], seed=args.seed + i + 1, **kw
                )
            rows = DEFAULT_ROWS if args.rows is None else _parse_rows(args.rows)
        else:
            adapters = dict(_parse_adapter(a) for a in args.adapter)  # refusals first
            base, what = _load_model(args.model, dtype, device), args.model
            truths = None
            rows = _parse_rows(args.rows) if args.rows else [*adapters, None]
        return _run(args, base, what, adapters, truths, rows, attach, dtype)


def _run(args, base, what, adapters, truths, rows, attach, dtype) -> int:
    check = not args.no_check
    model = copy.deepcopy(base) if check else base
    handle = attach(
        model,
        max_loras=args.max_loras or max(1, len(adapters)),
        max_lora_rank=args.max_lora_rank,
        moe_backend=args.moe_backend,
    )
    for name, path in adapters.items():
        handle.load_adapter(path, name=name)
    unknown = [r for r in rows if r is not None and r not in adapters]
    if unknown:
        raise ConfigError("--rows", unknown[0], f"'base' or a loaded adapter {sorted(adapters)}")
    tok = _tokenizer(args)
    pad = (
        0
        if tok is None
        else (tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)
    )
    prompts = [p.to(model.device) for p in _prompts(args, model, len(rows), tok)]
    ids, mask = _left_padded(prompts, model.device, pad)
    start = time.perf_counter()
    out = handle.generate(
        ids, adapter_names=rows, attention_mask=mask, max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad,
    )  # fmt: skip
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    mc = handle.model_config
    print(f"\nmoelora generate: {what}, {mc.model_type}, {len(mc.moe_layers)} MoE layers "
          f"(E={mc.shape.num_experts} K={mc.shape.top_k} H={mc.shape.hidden_size} "
          f"I={mc.shape.intermediate_size}), {str(dtype).split('.')[-1]} on {model.device}")  # fmt: skip
    print(f"  {len(rows)} rows, {args.max_new_tokens} new tokens each, left-padded prompts\n")
    print(f"  {'row':<4}{'adapter':<16}{'prompt':>6}  {'new tokens':<36}HF+PEFT alone")
    ok = True
    truth_of = None
    if check:
        truth_of = (
            (lambda n: base if n is None else truths[n]) if truths else _peft_truth(base, adapters)
        )
    logits = handle(ids, adapter_names=rows, attention_mask=mask).logits if check else None
    for row, (name, prompt) in enumerate(zip(rows, prompts)):
        new = out[row, ids.shape[1] :].tolist()
        verdict = "not checked"
        if check:
            verdict, row_ok = _check_row(
                truth_of(name), prompt, new, logits[row, ids.shape[1] - len(prompt) :], dtype, pad
            )
            ok = ok and row_ok
        shown = str(new) if len(str(new)) <= 34 else str(new)[:31] + "..."
        print(f"  {row:<4}{name or 'base':<16}{len(prompt):>6}  {shown:<36}{verdict}")
        if tok is not None:
            print(f"      {tok.decode(prompt)!r} -> {tok.decode(new)!r}")
    print(f"\n  {handle.selection.log_line()}")
    print(f"  generate: {elapsed:.2f} s for {len(rows)} rows")
    if check:
        print(
            f"  verdict: {'PASS' if ok else 'FAIL'} (each row against HF + PEFT generating it alone)"
        )
    else:
        print("  verdict: not checked (--no-check): no comparison ran")
    return 0 if ok else 1


def _check_row(truth, prompt, new, logits, dtype, pad: int) -> tuple[str, bool]:
    """(text, ok): the row's tokens against HF + PEFT alone; its prompt logits within the
    dtype tolerance. In 16-bit dtypes rounding can flip a near-tie: reported, not failed."""
    with torch.no_grad():
        want_logits = truth(input_ids=prompt[None]).logits[0]
        ref = truth.generate(
            input_ids=prompt[None], max_new_tokens=len(new), min_new_tokens=len(new),
            do_sample=False, pad_token_id=pad,
        )  # fmt: skip
    want = ref[0, len(prompt) :].tolist()
    err = compare(logits, want_logits, dtype)
    same = want == new
    if same:
        text = f"equal (logits {err.rel_err:.1e})"
    else:
        step = next(i for i, (a, b) in enumerate(zip(new, want)) if a != b)
        text = f"DIFFERS from step {step} (logits {err.rel_err:.1e})"
    return text, err.ok and (same or dtype != torch.float32)


def _peft_truth(base, adapters):
    """name -> HF + PEFT with that adapter alone: one PeftModel over `base` (the model
    moelora did not attach to) holding every adapter, set per row; base rows run with the
    adapters disabled. One copy of the weights besides moelora's."""
    from peft import PeftModel

    state: dict = {}

    def truth(name):
        if "peft" not in state:
            first, *rest = adapters.items()
            state["peft"] = PeftModel.from_pretrained(base, str(first[1]), adapter_name=first[0])
            for adapter, path in rest:
                state["peft"].load_adapter(str(path), adapter_name=adapter)
            state["peft"].eval()
        peft_model = state["peft"]
        if name is None:
            return _Disabled(peft_model)
        peft_model.set_adapter(name)
        return peft_model

    return truth if adapters else (lambda name: base)


class _Disabled:
    """A PeftModel called and generating with its adapters off (the base model)."""

    def __init__(self, peft_model) -> None:
        self.peft_model = peft_model

    def __call__(self, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(**kwargs)

    def generate(self, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model.generate(**kwargs)


def _tokenizer(args):
    """The model directory's tokenizer, or None (random models, directories without one)."""
    root = Path(args.model) if args.model else None
    if root is None or not any(
        (root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        if args.prompt:
            raise ConfigError(
                "--prompt",
                args.prompt[0],
                "a --model directory with a tokenizer (tokenizer.json)",
                "save the tokenizer beside the model, or leave --prompt out (random prompts)",
            )
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root), local_files_only=True)


def _prompts(args, model, count: int, tok) -> list[torch.Tensor]:
    if args.prompt:
        texts = (args.prompt * count)[:count]
        return [torch.tensor(tok(t)["input_ids"]) for t in texts]
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [5 + (3 * row) % 7 for row in range(count)]
    return [torch.randint(1, model.config.vocab_size, (n,), generator=gen) for n in lengths]


def _left_padded(prompts, device, pad: int = 0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    return ids, mask


def _parse_rows(text: str) -> list[str | None]:
    return [None if r.strip() in ("base", "none", "") else r.strip() for r in text.split(",")]


def _parse_adapter(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError("--adapter", text, "NAME=DIR", "e.g. --adapter math=./adapters/math")
    return name, Path(path)


def _load_model(path: str, dtype, device):
    from transformers import AutoModelForCausalLM

    root = Path(path)
    if not (root / "config.json").is_file():
        raise ConfigError(
            "--model", path, "a model directory with config.json", "save_pretrained one"
        )
    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, local_files_only=True)
    return model.to(device).eval()
