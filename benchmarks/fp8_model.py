"""The two phases of benchmarks/fp8_generate.py and the generate calls both time (`Runs`,
`time_batches`). The bf16 phase times moelora on the model as built. The FP8 phase loads the
FP8 checkpoint with transformers, says how it holds the experts and what moelora serves,
checks one mixed batch's rows against transformers' own FP8 model (base row) and the W8A8
truth (adapter rows, with the measured noise), then times moelora against transformers' own
FP8 experts."""

from __future__ import annotations

from pathlib import Path

import torch

from moelora.bench.model_level import Clock
from moelora.compare import NOISE_FACTOR, REL_TOL, compare
from moelora.truth import w8a8

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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
        found = w8a8.fp8_layer_from_module(experts, (block, block))
        if found is None:
            found = w8a8.fp8_layer_from_files(root, index, (block, block), device)
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

    from moelora.hf import attach

    model = load(root, device, DTYPES[a.dtype])
    _dispatches(model, emit)
    layers, about = truth_layers(model, root, a.block, device)
    kept = getattr(model.config, "quantization_config", None) is not None
    if not kept:  # transformers dequantized and dropped it: the directory's config says FP8
        qc = json.loads((root / "config.json").read_text())["quantization_config"]
        model.config.quantization_config = qc
    hf_own = model.config._experts_implementation or "grouped_mm"
    twin = fp32_twin(model) if a.dtype != "fp32" else None
    handle = attach(model, num_slots=a.adapters, max_rank=a.rank)
    for name, path in adapters.items():
        handle.load_adapter(path, name=name)
    served = handle.layers[min(handle.layers)].experts
    emit(kind="fp8_setup", **about, hf_kept_quantization_config=kept,
         hf_experts_implementation=hf_own, backend=handle.backend_name,
         moelora_served=f"{type(served).__name__} from {getattr(served, 'source', 'module')}")  # fmt: skip
    truth = w8a8.install(model, layers, adapters)
    runs = Runs(model, handle, a.adapters, hf_own, Clock(device))
    hf_runs = _hf_runs(runs, device, emit)
    emit(**check(a, runs, truth, device, hf_runs, twin))
    label = {"ml": f"moelora_fp8_{a.adapters}_mixed", "hf": f"hf_fp8_base_{hf_own}"}
    time_batches(a, runs, ["hf", "ml"] if hf_runs else ["ml"], label, emit, device)


def _dispatches(model, emit) -> None:
    """Stop unless the experts modules dispatch through transformers' experts interface (a
    forward wrapped by use_experts_implementation): otherwise neither moelora nor the truth
    would run in them, and transformers' own loop would answer for both."""
    experts = model.model.layers[0].mlp.experts
    if not hasattr(type(experts).forward, "__wrapped__"):
        name = type(experts).__name__
        emit(kind="error", what=f"{name}.forward does not dispatch on the experts implementation")
        raise SystemExit(f"{name}: transformers' experts interface is not used by this module")


def _hf_runs(runs, device: str, emit) -> bool:
    """Whether transformers' own FP8 experts generate here (5.24's need the `kernels`
    package and its hub kernel); if not, says why, and the run goes on without them."""
    try:  # a prefill and decode steps, as the timing runs them
        runs.hf(torch.ones(2, 4, dtype=torch.long, device=device), 3)
        return True
    except Exception as err:  # any failure of HF's kernels: report it, go on
        emit(kind="hf_fp8_unavailable", implementation=runs.hf_own,
             error=f"{type(err).__name__}: {str(err)[:300]}")  # fmt: skip
        return False


def _prompt_logits(runs, implementation: str, ids) -> torch.Tensor:
    """Prompt logits under the experts `implementation`; under the W8A8 truth, FP8Linear
    projections (a published checkpoint's attention) compute the truth's arithmetic too."""
    runs.model.set_experts_implementation(implementation)
    with torch.no_grad(), _truth_linears(runs.model, implementation):
        return runs.model(input_ids=ids).logits[0].float()


def _truth_linears(model, implementation: str):
    import contextlib

    if implementation == w8a8.NAME:
        return w8a8.fp8_linears_as_truth(model)
    return contextlib.nullcontext()


def _rel(out, ref) -> float:
    return compare(out, ref, tol=float("inf")).rel_err


def check(a, runs, truth, device: str, hf_runs: bool, twin) -> dict:
    """One mixed batch (each adapter, then a base row) through moelora against the truths:
    equal leading tokens of the first --check-new, and prompt logits rel err, per row. The
    base row's truth is transformers' own FP8 model (the W8A8 truth where it cannot run)."""
    names = [f"a{k}" for k in range(a.adapters)] + [None]
    gen = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(1, runs.model.config.vocab_size, (len(names), a.check_prompt),
                        generator=gen).to(device)  # fmt: skip
    n, width = a.check_new, ids.shape[1]
    runs.model.set_experts_implementation("moelora")
    out = runs.handle.generate(ids, adapter_names=names, max_new_tokens=n, min_new_tokens=n,
                               **runs.kw)  # fmt: skip
    with torch.no_grad():
        mine = runs.handle(ids, adapter_names=names).logits.float()
    result = []
    for row, name in enumerate(names):
        own = name is None and hf_runs
        truth.select(name)
        want = _prompt_logits(runs, runs.hf_own if own else w8a8.NAME, ids[[row]])
        with torch.no_grad(), _truth_linears(runs.model, runs.hf_own if own else w8a8.NAME):
            ref = runs.model.generate(input_ids=ids[[row]], max_new_tokens=n, min_new_tokens=n,
                                      **runs.kw)  # fmt: skip
        equal = int((out[row, width:] == ref[0, width:]).cumprod(0).sum())
        result.append(dict(row=row, adapter=name, equal_prefix_tokens=equal,
                           truth="hf_own_fp8" if own else "w8a8_truth+peft_delta",
                           logits_rel_err=_rel(mine[row], want)))  # fmt: skip
    measured = _noise(runs, truth, ids, mine, names, hf_runs, twin)
    # every row within the tolerance (NaN fails), and an adapter moving its row past it
    ok = all(r["logits_rel_err"] <= measured["tol"] for r in result)
    ok = ok and measured["adapter_effect_rel_err"] > measured["tol"]
    return dict(kind="check", of=n, rows=result, **measured, ok=ok)


def fp32_twin(model):
    """A copy of `model` with its non-expert weights in fp32 and its experts modules shared
    (nothing of them copied; they follow `model`'s experts implementation): the W8A8 truth
    on it is the truth in fp32 between the experts, for the noise of the serving dtype."""
    import copy

    shared = {id(layer.mlp.experts): layer.mlp.experts for layer in model.model.layers}
    twin = copy.deepcopy(model, memo=dict(shared))
    for module in twin.modules():
        if id(module) in shared:
            continue
        for key, p in module._parameters.items():
            if p is not None and p.dtype in (torch.bfloat16, torch.float16):
                module._parameters[key] = torch.nn.Parameter(p.data.float(), requires_grad=False)
    return twin


def _noise(runs, truth, ids, mine, names, hf_runs: bool, twin) -> dict:
    """The measured noise on the base row: transformers' own FP8 experts against the W8A8
    truth (where they run), and the truth in the serving dtype against the truth with fp32
    between the experts (`twin`; none in fp32); the tolerance they set (generate's 16-bit
    rule, in every dtype: max(the table, 2 x the larger)); what the check resolves (the
    first adapter's effect on its row; the base row against the W8A8 truth)."""
    base = len(names) - 1
    truth.select(None)
    w8a8_base = _prompt_logits(runs, w8a8.NAME, ids[[base]])
    noise = {"hf_own_vs_w8a8": None, "w8a8_vs_w8a8_fp32": None}
    if twin is not None:  # the shared experts run the truth: `model` has it selected
        with torch.no_grad(), w8a8.fp8_linears_as_truth(twin):
            exact = twin(input_ids=ids[[base]]).logits[0].float()
        noise["w8a8_vs_w8a8_fp32"] = _rel(w8a8_base, exact)
    if hf_runs:
        noise["hf_own_vs_w8a8"] = _rel(_prompt_logits(runs, runs.hf_own, ids[[base]]), w8a8_base)
    plain = _prompt_logits(runs, w8a8.NAME, ids[[0]])
    truth.select(names[0])
    effect = _rel(_prompt_logits(runs, w8a8.NAME, ids[[0]]), plain)
    table = REL_TOL[runs.model.dtype]
    measured = [v for v in noise.values() if v is not None]
    tol = max([table] + [NOISE_FACTOR * v for v in measured])
    if any(v != v for v in measured):  # NaN noise: a NaN tolerance, which every row fails
        tol = float("nan")
    rule = f"max(the {runs.model.dtype} table, {NOISE_FACTOR} x the larger noise)"
    return dict(noise_rel_err=noise, adapter_effect_rel_err=effect, tol=tol, rule=rule,
                base_row_vs_w8a8_truth_rel_err=_rel(mine[base], w8a8_base))  # fmt: skip


class Runs:
    """The generate calls the benchmark times: moelora on mixed adapters, transformers on
    base rows with its own experts implementation `hf_own`."""

    def __init__(self, model, handle, adapters: int, hf_own: str, clock: Clock) -> None:
        self.model, self.handle, self.adapters, self.hf_own = model, handle, adapters, hf_own
        self.clock = clock
        self.kw = dict(do_sample=False, pad_token_id=0)

    def names(self, rows: int) -> list[str]:
        return [f"a{i % self.adapters}" for i in range(rows)]

    def ml(self, ids, new: int):
        self.model.set_experts_implementation("moelora")
        return self.handle.generate(ids, adapter_names=self.names(ids.shape[0]),
                                    max_new_tokens=new, min_new_tokens=new, **self.kw)  # fmt: skip

    def hf(self, ids, new: int):
        self.model.set_experts_implementation(self.hf_own)
        with torch.no_grad():
            return self.model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new,
                                       **self.kw)  # fmt: skip

    def prefill(self, which: str, ids) -> float:
        def call():
            with torch.no_grad():
                if which == "hf":
                    self.model.set_experts_implementation(self.hf_own)
                    self.model(input_ids=ids)
                else:
                    self.model.set_experts_implementation("moelora")
                    self.handle(ids, adapter_names=self.names(ids.shape[0]))

        return self.clock.time(call)


def time_batches(a, runs: Runs, which: list[str], label: dict, emit, device) -> None:
    """Tokens/s, prefill and decode of each of `which` ("ml", "hf") at each batch: a warm-up
    at every timed shape first, then --repeats passes alternating, the order flipped."""
    vocab = runs.model.config.vocab_size
    batches = [int(b) for b in a.batches.split(",")]
    gen = torch.Generator().manual_seed(a.seed + 2)
    shapes = {b: torch.randint(1, vocab, (b, a.prompt), generator=gen).to(device) for b in batches}
    for ids in shapes.values():
        for w in which:
            getattr(runs, w)(ids, a.new), runs.prefill(w, ids)
    for b, ids in shapes.items():
        times = {w: ([], [], []) for w in which}
        for rep in range(a.repeats):
            for w in which if rep % 2 == 0 else which[::-1]:
                seconds, peak = runs.clock.time_and_peak(getattr(runs, w), ids, a.new)
                times[w][0].append(seconds)
                times[w][1].append(runs.prefill(w, ids))
                times[w][2].append(peak)
        for w in which:
            total, pre = min(times[w][0]), min(times[w][1])
            emit(kind=label[w], batch=b, tok_s=round(b * a.new / total, 1),
                 prefill_ms=round(pre * 1e3, 2),
                 decode_tok_s=round(b * (a.new - 1) / max(total - pre, 1e-9), 1),
                 peak_gib=max(times[w][2]))  # fmt: skip


def full_precision_phase(a, model, adapters: dict[str, Path], emit, device: str) -> None:
    from moelora.hf import attach

    hf_own = model.config._experts_implementation or "grouped_mm"
    handle = attach(model, num_slots=a.adapters, max_rank=a.rank)
    for name, path in adapters.items():
        handle.load_adapter(path, name=name)
    emit(kind=f"{a.dtype}_setup", backend=handle.backend_name)
    runs = Runs(model, handle, a.adapters, hf_own, Clock(device))
    time_batches(a, runs, ["ml"], {"ml": f"moelora_{a.dtype}_{a.adapters}_mixed"}, emit, device)
    handle.detach()
