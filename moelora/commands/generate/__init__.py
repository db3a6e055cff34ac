"""`moelora generate`: a transformers MoE model generating one mixed batch, each row with its
own PEFT adapter (or the base model), through moelora.hf.attach.

With no --model it builds a small random Qwen3-MoE model with transformers' own classes
(no download; larger and bf16 on a GPU), writes four random adapters with PEFT's own
save_pretrained (two PEFT layouts, ranks 1 to 8, one with attention LoRA), loads them and
generates a left-padded batch of five rows (four adapters and a base row). Each row is
checked against HF + PEFT generating that row alone with its adapter (check.py:
equal tokens in fp32; in bf16 / fp16 logits within a tolerance calibrated in the run
against the noise between two of HF's own experts implementations, truth/hf_peft.py).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config import parse_dtype
from ...deployment import dtype_name
from ...errors import AdapterError, AdapterProblems, ConfigError, adapter_refusal
from ...truth.hf_peft import measure_noise, peft_truth, runnable_implementation, set_implementation
from ..flag_terms import VLLM_LORA_FLAGS
from ..flag_types import positive_int, utf8_text
from . import inputs
from .check import CheckResult, check_row, verdict
from .report import Run, as_json, exit_code, rank_note, text

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
        help="the main job: a transformers MoE model generating one batch whose rows each use "
        "their own LoRA adapter (default: a random model and four PEFT adapters, each row "
        "checked against HF + PEFT generating it alone)",
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
    p.add_argument(
        "--prompt", action="append", default=[], type=utf8_text,
        help="a prompt (needs a tokenizer)",
    )  # fmt: skip
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=8, help="tokens to generate (default 8)"
    )
    p.add_argument(
        "--max-loras", type=positive_int, default=None, help="adapter slots (default: enough)"
    )
    p.add_argument(
        "--max-lora-rank", type=positive_int, default=16, help="max LoRA rank (default 16)"
    )
    p.add_argument("--moe-backend", default="auto", help="auto or a backend name")
    p.add_argument("--dtype", default="auto", help="auto (fp32: exact check) or bf16 / fp16")
    p.add_argument(
        "--fused-orientation", choices=("natural", "swapped"), default=None,
        help="how fused gate_up_proj LoRA factors read when their shapes fit both ways "
        "(H = 2 I): natural (PEFT >= 0.18) or swapped (PEFT 0.17); default: from the "
        "adapter's peft_version, else refused as ambiguous",
    )  # fmt: skip
    p.add_argument(
        "--no-check", action="store_true", help="skip the HF+PEFT row-by-row check"
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(run=run, flag_terms=VLLM_LORA_FLAGS)


def run(args: argparse.Namespace) -> int:
    # transformers' own deprecation notes, raised when PEFT calls it: nothing a user acts on
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\.")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    # PEFT's note on a rank_pattern key its own gate/up rewrite left unused (the adapter
    # loads as saved; moelora checks every factor's shape itself)
    warnings.filterwarnings("ignore", message=".*rank_pattern keys did not match.*")
    if not args.verbose:  # the summary names each adapter with its rank and why; -v adds the log
        logging.getLogger("moelora.hf").setLevel(logging.WARNING)
    cuda = torch.cuda.is_available()
    if not cuda:
        # No GPU: Triton kernels (when asked for) run through Triton's interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from transformers.utils import logging as hf_logging

    from ...hf import attach, toy

    hf_logging.disable_progress_bar()  # a loading bar per model: nothing a reader acts on

    device = "cuda" if cuda else "cpu"
    # fp32 by default, on a GPU too: both sides then compute exactly (IEEE fp32 dots), so the
    # check can demand equal tokens; in bf16 (--dtype bf16, what serving runs) rounding can
    # flip a near-tie and only the logits are held, to a tolerance calibrated in the run.
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
            rows = DEFAULT_ROWS if args.rows is None else inputs.parse_rows(args.rows)
        else:
            adapters = inputs.parse_adapters(args.adapter)  # refusals first
            base, what = inputs.load_model(args.model, dtype, device), args.model
            truths = None
            rows = inputs.parse_rows(args.rows) if args.rows else [*adapters, None]
        return _run(args, base, what, adapters, truths, rows, attach, dtype)


def _attach(attach, model, args, adapters):
    """moelora on `model` (an oracle refusal reaches the user in generate's own flags:
    cli.py prints it through flag_terms.error_text)."""
    return attach(
        model,
        num_slots=args.max_loras or max(1, len(adapters)),
        max_rank=args.max_lora_rank,
        moe_backend=args.moe_backend,
    )


def _load(handle, path: Path, name: str, orientation: str | None) -> str:
    """One adapter; returns its rank, in words. A refusal whose fix names the library's
    keyword is restated with generate's flag only."""
    try:
        handle.load_adapter(path, name=name, fused_orientation=orientation)
    except AdapterError as err:
        problems = err.problems if isinstance(err, AdapterProblems) else (err,)
        if not any("fused_orientation=" in p.fix for p in problems):
            raise
        raise adapter_refusal([_flag_fix(p) for p in problems]) from None
    rank = handle.describe(name)["rank"]
    note = rank_note(path, rank)
    return f"rank {rank}" + (f" ({note})" if note else "")


def _flag_fix(err: AdapterError) -> AdapterError:
    if "fused_orientation=" not in err.fix:
        return err
    fix = "--fused-orientation natural (PEFT >= 0.19.1 saves it so) or swapped (PEFT <= 0.18.1)"
    return AdapterError(err.file, err.key, err.found, err.expected, fix)


@dataclass(frozen=True)
class Batch:
    """One generate call: the adapter per row, prompts [S] each, the left-padded ids and
    attention mask [B, S_max], the pad id, and each row's new tokens."""

    rows: list[str | None]
    prompts: list[torch.Tensor]
    ids: torch.Tensor
    mask: torch.Tensor
    pad: int
    new: list[list[int]]


def _run(args, base, what, adapters, truths, rows, attach, dtype) -> int:
    from . import fp8  # imports transformers: only once a run needs it

    unknown = [r for r in rows if r is not None and r not in adapters]
    if unknown:
        raise ConfigError("--rows", unknown[0], f"'base' or a loaded adapter {sorted(adapters)}")
    tok = inputs.tokenizer(args.model, args.prompt)
    prompts = inputs.prompts(args.prompt, base.config.vocab_size, len(rows), tok, args.seed)
    inputs.check_positions(prompts, args.max_new_tokens, base.config)  # before anything runs
    check = not args.no_check
    model = copy.deepcopy(base) if check else base
    handle = _attach(attach, model, args, adapters)
    orientation = args.fused_orientation
    ranks = {name: _load(handle, path, name, orientation) for name, path in adapters.items()}
    batch, seconds = _generate(handle, rows, prompts, _pad_id(tok), args.max_new_tokens)
    checked = None
    if check and args.model is not None and fp8.is_fp8(base):
        checked = fp8.check(base, args.model, adapters, batch, handle)  # W8A8 truth
    elif check:
        checked = _check(base, adapters, truths, batch, handle, dtype)
    mc, sel = handle.model_config, handle.selection
    shape = mc.shape
    result = Run(
        what=what,
        header=f"{mc.model_type}, {len(mc.moe_layers)} MoE layers (E={shape.num_experts} "
        f"K={shape.top_k} H={shape.hidden_size} I={shape.intermediate_size}), "
        f"{dtype_name(dtype)} on {model.device}",
        dtype=dtype_name(dtype),
        rows=rows,
        prompts=[p.tolist() for p in batch.prompts],
        new=batch.new,
        texts=None
        if tok is None
        else [tuple(map(tok.decode, t)) for t in zip(batch.prompts, batch.new)],
        adapters=ranks,
        selection=sel.log_line(),
        backend=sel.name,
        interpreted=sel.interpreted,
        seconds=seconds,
        check=checked,
    )
    print(as_json(result) if args.json else text(result, args.max_new_tokens))
    return exit_code(result)


def _pad_id(tok) -> int:
    if tok is None:
        return 0
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0


def _generate(handle, rows, prompts, pad: int, max_new_tokens: int) -> tuple[Batch, float]:
    """The mixed batch through moelora, greedy; (the batch with its new tokens, seconds)."""
    device = handle.model.device
    prompts = [p.to(device) for p in prompts]
    ids, mask = inputs.left_padded(prompts, device, pad)
    start = time.perf_counter()
    out = handle.generate(
        ids, adapter_names=rows, attention_mask=mask, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = [out[row, ids.shape[1] :].tolist() for row in range(len(rows))]
    return Batch(rows, prompts, ids, mask, pad, new), seconds


def _check(base, adapters, truths, batch: Batch, handle, dtype) -> CheckResult:
    """Each row against HF + PEFT alone (truth/hf_peft.py), and the verdict (check.py)."""
    rows, prompts = batch.rows, batch.prompts
    # HF in fp32, for the noise of 16-bit runs: copied before PEFT wraps `base` in place
    base32 = copy.deepcopy(base).float() if dtype != torch.float32 else None
    truth_of, models = _truth(base, adapters, truths)
    implementation = runnable_implementation(models, truth_of(rows[0]), prompts[0])
    noise = []
    if base32 is not None:  # HF against itself: another implementation, and fp32
        truths32 = truths and {n: copy.deepcopy(t).float() for n, t in truths.items()}
        truth32_of, models32 = _truth(base32, adapters, truths32)
        set_implementation(models32, "eager")
        noise = measure_noise(models, truth_of, truth32_of, rows, prompts, implementation)
    with torch.no_grad():
        logits = handle(batch.ids, adapter_names=rows, attention_mask=batch.mask).logits
    checks = []
    width = batch.ids.shape[1]
    for row, (name, prompt) in enumerate(zip(rows, prompts)):
        mine = logits[row, width - len(prompt) :]
        checks.append(check_row(truth_of(name), row, name, prompt, batch.new[row], mine, batch.pad))
    return CheckResult(checks, implementation, noise, verdict(checks, dtype, noise))


def _truth(base, adapters, truths):
    """(name -> HF + PEFT with that adapter alone, the HF models under it)."""
    if truths:
        models = [base, *(t.get_base_model() for t in truths.values())]
        return (lambda n: base if n is None else truths[n]), models
    return peft_truth(base, adapters), [base]
