"""The outside truth `moelora generate` checks its rows against: HF + PEFT generating each
row alone with its adapter, on an experts implementation of transformers that runs on this
device, and the noise between two of HF's own experts implementations on the same model.

Why the noise: in bf16 two correct implementations of the same model differ (rounding in
another order), by an amount that grows with depth (2.9-4.2% first-step logits on a 48-layer
Qwen3-30B-A3B shape, ENVIRONMENT.md). A fixed table tolerance then fails correct runs on
deep models; the check instead allows moelora what HF allows itself, measured in the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..compare import compare

# HF's experts implementations, tried in this order for the check: transformers' default
# first; batched_mm and eager run where grouped_mm's 16-byte stride rule refuses (bf16 with
# I * 2 bytes not a multiple of 16, as the CPU toy's I = 12).
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
# Each adapter is loaded into PEFT under its own neutral name: PEFT warns about (and can
# misparse) names contained in its "lora_" prefix, such as "a" or "lora".
_PEFT_NAME = "adapter{}"


@dataclass(frozen=True)
class Noise:
    """One measure of HF's own disagreement on this model: `between` (two experts
    implementations, or HF in this dtype against HF in fp32), the largest relative error of
    the prompt logits over the rows, and the row (`row`, adapter `name`) that had it."""

    between: str
    rel_err: float
    row: int
    name: str | None

    def describe(self) -> str:
        return (
            f"HF's own noise, {self.between}: prompt logits rel err {self.rel_err:.1e} "
            f"(largest: row {self.row} {self.name or 'base'})"
        )


def peft_truth(base, adapters: dict) -> Callable:
    """name -> HF + PEFT with that adapter alone: one PeftModel over `base` (the model
    moelora did not attach to) holding every adapter, set per row; base rows run with the
    adapters disabled. One copy of the weights besides moelora's."""
    from peft import PeftModel

    state: dict = {}
    internal = {name: _PEFT_NAME.format(i) for i, name in enumerate(adapters)}

    def truth(name):
        if "peft" not in state:
            (first, path), *rest = adapters.items()
            state["peft"] = PeftModel.from_pretrained(base, str(path), adapter_name=internal[first])
            for adapter, path in rest:
                state["peft"].load_adapter(str(path), adapter_name=internal[adapter])
            state["peft"].eval()
        peft_model = state["peft"]
        if name is None:
            return Disabled(peft_model)
        peft_model.set_adapter(internal[name])
        return peft_model

    return truth if adapters else (lambda name: base)


class Disabled:
    """A PeftModel called and generating with its adapters off (the base model)."""

    def __init__(self, peft_model) -> None:
        self.peft_model = peft_model

    def __call__(self, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(**kwargs)

    def generate(self, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model.generate(**kwargs)


def set_implementation(models: Sequence, name: str) -> None:
    """Select HF experts implementation `name` on every model under the truth."""
    for model in models:
        model.set_experts_implementation(name)


def runnable_implementation(models: Sequence, truth, prompt: torch.Tensor) -> str:
    """The first of EXPERTS_IMPLEMENTATIONS that runs a forward of `truth` on `prompt` [S]
    here, left set on `models` (the HF models under the truth). The last one (eager: plain
    torch) is not tried: it is what remains."""
    for name in EXPERTS_IMPLEMENTATIONS[:-1]:
        set_implementation(models, name)
        try:
            with torch.no_grad():
                truth(input_ids=prompt[None])
            return name
        except RuntimeError:  # e.g. grouped_mm: "strides should be multiple of 16 bytes"
            continue
    set_implementation(models, EXPERTS_IMPLEMENTATIONS[-1])
    return EXPERTS_IMPLEMENTATIONS[-1]


def _worst(between: str, pairs) -> Noise:
    """The Noise of the largest relative error over (row, name, out, ref) tuples."""
    worst = None
    for row, name, out, ref in pairs:
        err = compare(out, ref, tol=float("inf")).rel_err
        if worst is None or not err <= worst.rel_err:  # NaN is kept: it must decide
            worst = Noise(between, err, row, name)
    return worst


def _logits(truth, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return truth(input_ids=prompt[None]).logits[0].float()


def measure_noise(
    models: Sequence,
    truth_of: Callable,
    truth32_of: Callable,
    rows: Sequence[str | None],
    prompts: Sequence[torch.Tensor],
    chosen: str,
) -> list[Noise]:
    """HF's disagreement with itself on the rows' prompts [S]: the prompt logits on
    `chosen` against another experts implementation (eager, or batched_mm when `chosen` is
    eager), and against HF in fp32 (`truth32_of`: the same adapters on an fp32 copy).
    Why both: on a CPU batched_mm and eager round alike (0 apart), while an fp32-accumulating
    kernel (moelora's) sits between the bf16 and the fp32 result. Leaves `chosen` set."""
    second = "eager" if chosen != "eager" else "batched_mm"
    set_implementation(models, second)
    other = [_logits(truth_of(name), p) for name, p in zip(rows, prompts)]
    set_implementation(models, chosen)
    mine = [_logits(truth_of(name), p) for name, p in zip(rows, prompts)]
    exact = [_logits(truth32_of(name), p) for name, p in zip(rows, prompts)]
    named = list(enumerate(rows))
    return [
        _worst(f"{chosen} vs {second} experts", [(r, n, mine[r], other[r]) for r, n in named]),
        _worst(f"{chosen} vs HF in float32", [(r, n, mine[r], exact[r]) for r, n in named]),
    ]
