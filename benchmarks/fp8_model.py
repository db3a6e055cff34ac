"""The FP8 half of benchmarks/fp8_generate.py: load the FP8 checkpoint with transformers,
say how it holds the experts and what moelora serves, check one mixed batch's rows against
transformers' own FP8 model (base row) and the W8A8 truth (adapter rows, with the measured
noise), then time moelora against transformers' own FP8 experts."""

from __future__ import annotations

from pathlib import Path

import torch

from moelora.commands import fp8_truth
from moelora.commands.generate_check import NOISE_FACTOR
from moelora.compare import REL_TOL, compare


def load(root: Path, device: str, dtype: torch.dtype):
    """transformers' own load of the FP8 directory, in `dtype`, on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(root), dtype=dtype, device_map=device, local_files_only=True
    )
    return model.eval()


def truth_layers(model, root: Path, block: int, device: str) -> tuple[dict, dict]:
    """Each layer's FP8 weights for the truth (the module's own e4m3 tensors, else the
    checkpoint's), and how transformers holds the experts: in words, and where it holds
    them dequantized, the largest rel err of its weights against the exact dequantization
    (bf16 rounding: ~4e-3; a checkpoint it misread: ~1)."""
    layers, held, worst = {}, set(), None
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        found = fp8_truth.fp8_layer_from_module(experts, (block, block))
        if found is None:
            found = fp8_truth.fp8_layer_from_files(root, index, (block, block), device)
            w13, w2 = found.expert(0)
            for mine, exact in ((experts.gate_up_proj[0], w13), (experts.down_proj[0], w2)):
                err = compare(mine.float(), exact, tol=float("inf")).rel_err
                worst = err if worst is None else max(worst, err)
            held.add(f"dequantized {experts.down_proj.dtype}")
        else:
            held.add(f"{type(experts).__name__} e4m3")
        layers[index] = found
    about = {"hf_experts": ", ".join(sorted(held))}
    if worst is not None:
        about["hf_dequantized_rel_err"] = worst
    return layers, about


def fp8_phase(a, root: Path, adapters: dict[str, Path], emit, device: str) -> None:
    import json

    from benchmarks.fp8_generate import DTYPES, Clock, Runs, time_batches
    from moelora.hf import attach, experts

    model = load(root, device, DTYPES[a.dtype])
    layers, about = truth_layers(model, root, a.block, device)
    kept = getattr(model.config, "quantization_config", None) is not None
    if not kept:  # transformers dequantized and dropped it: the directory's config says FP8
        qc = json.loads((root / "config.json").read_text())["quantization_config"]
        model.config.quantization_config = qc
    hf_own = model.config._experts_implementation or "grouped_mm"
    handle = attach(model, num_slots=a.adapters, max_rank=a.rank)
    for name, path in adapters.items():
        handle.load_adapter(path, name=name)
    served = experts._bindings[handle._bound[0][0]._moelora_key].layer.experts
    emit(kind="fp8_setup", **about, hf_kept_quantization_config=kept,
         hf_experts_implementation=hf_own, backend=handle.backend_name,
         moelora_served=f"{type(served).__name__} from {getattr(served, 'source', 'module')}")  # fmt: skip
    truth = fp8_truth.install(model, layers, adapters)
    runs = Runs(model, handle, a.adapters, hf_own, Clock(device))
    emit(**check(a, runs, truth, device))
    label = {"ml": f"moelora_fp8_{a.adapters}_mixed", "hf": f"hf_fp8_base_{hf_own}"}
    time_batches(a, runs, ["hf", "ml"], label, emit, device)


def _prompt_logits(runs, implementation: str, ids) -> torch.Tensor:
    runs.model.set_experts_implementation(implementation)
    with torch.no_grad():
        return runs.model(input_ids=ids).logits[0].float()


def check(a, runs, truth, device: str) -> dict:
    """One mixed batch (each adapter, then a base row) through moelora against the truths:
    equal leading tokens of the first --check-new, and prompt logits rel err, per row."""
    names = [f"a{k}" for k in range(a.adapters)] + [None]
    gen = torch.Generator().manual_seed(a.seed + 1)
    vocab = runs.model.config.vocab_size
    ids = torch.randint(1, vocab, (len(names), a.check_prompt), generator=gen).to(device)
    n, width = a.check_new, ids.shape[1]
    runs.model.set_experts_implementation("moelora")
    out = runs.handle.generate(ids, adapter_names=names, max_new_tokens=n, min_new_tokens=n,
                               **runs.kw)  # fmt: skip
    with torch.no_grad():
        mine = runs.handle(ids, adapter_names=names).logits.float()
    result = []
    for row, name in enumerate(names):
        which = runs.hf_own if name is None else fp8_truth.NAME
        truth.select(name)
        want = _prompt_logits(runs, which, ids[[row]])
        with torch.no_grad():
            ref = runs.model.generate(input_ids=ids[[row]], max_new_tokens=n, min_new_tokens=n,
                                      **runs.kw)  # fmt: skip
        equal = int((out[row, width:] == ref[0, width:]).cumprod(0).sum())
        err = compare(mine[row], want, tol=float("inf")).rel_err
        truth_name = "hf_own_fp8" if name is None else "w8a8_truth+peft_delta"
        result.append(dict(row=row, adapter=name, truth=truth_name, equal_prefix_tokens=equal,
                           logits_rel_err=err))  # fmt: skip
    base = ids[[len(names) - 1]]
    truth.select(None)
    w8a8_base = _prompt_logits(runs, fp8_truth.NAME, base)
    noise = compare(_prompt_logits(runs, runs.hf_own, base), w8a8_base, tol=float("inf")).rel_err
    truth.select(names[0])  # how far the first adapter moves its row: the check's resolution
    adapted = _prompt_logits(runs, fp8_truth.NAME, ids[[0]])
    truth.select(None)
    plain = _prompt_logits(runs, fp8_truth.NAME, ids[[0]])
    effect = compare(adapted, plain, tol=float("inf")).rel_err
    # the rule of generate's 16-bit check, in every dtype: the base row's truth is
    # transformers' own FP8 model, whose experts may differ from W8A8 (dequantized: none)
    tol = max(REL_TOL[runs.model.dtype], NOISE_FACTOR * noise)
    rule = f"max(the {runs.model.dtype} table, {NOISE_FACTOR} x the noise)"
    base_w8a8 = compare(mine[len(names) - 1], w8a8_base, tol=float("inf")).rel_err
    ok = all(r["logits_rel_err"] <= tol for r in result)
    return dict(kind="check", of=n, rows=result, noise_rel_err=noise, adapter_effect_rel_err=effect,
                base_row_vs_w8a8_truth_rel_err=base_w8a8, tol=tol, rule=rule, ok=ok)  # fmt: skip
