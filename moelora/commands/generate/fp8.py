"""`moelora generate --model DIR`'s check when the model it loaded is FP8 (its config's
quantization_config kept: transformers holds the experts as its FP8Experts, on a GPU >=
sm89, or the config says FP8 while the experts were dequantized): PEFT cannot be the truth
there (it merges its delta into a weight an e4m3 tensor cannot hold), so every row is
checked against the W8A8 truth (truth/w8a8.py: transformers' eager experts loop, base GEMMs
on inputs quantized per token and block, PEFT's delta weight on the unquantized rows, and
the checkpoint's FP8Linear projections, if any, as truth/w8a8.fp8_linear computes them),
alone. The noise: the rows' prompts on the base model under transformers' own FP8 experts
against that truth (none where transformers' FP8 kernels do not run here).
The tolerance: the FP8 row of the table or twice the noise, the larger; tokens may part
after an e4m3 rounding flip, so only the logits are held (check.py's 16-bit rule).

Where transformers dequantized the experts and dropped the config (a CPU), the model is a
plain bf16 / fp32 one and generate's usual HF + PEFT check applies.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...compare import compare
from ...config import from_hf
from ...errors import ConfigError
from ...truth import w8a8
from ...truth.hf_peft import Noise
from .check import CheckResult, check_row, verdict


def is_fp8(model) -> bool:
    """Whether `model`'s config (as transformers left it after loading) says FP8."""
    return from_hf(model.config.to_dict(), name="model").quantization.method.is_fp8


class W8A8Truth:
    """The truth for one row: `model` (the HF model moelora did not attach to) on the W8A8
    experts implementation with adapter `name` (None: the base), called or generating as
    check_row calls HF + PEFT."""

    def __init__(self, model, deltas: w8a8.PeftDeltas, name: str | None) -> None:
        self.model, self.deltas, self.name = model, deltas, name

    def __call__(self, **kwargs):
        self.deltas.select(self.name)
        self.model.set_experts_implementation(w8a8.NAME)
        with w8a8.fp8_linears_as_truth(self.model):
            return self.model(**kwargs)

    def generate(self, **kwargs):
        self.deltas.select(self.name)
        self.model.set_experts_implementation(w8a8.NAME)
        with w8a8.fp8_linears_as_truth(self.model):
            return self.model.generate(**kwargs)


def install_truth(base, model_dir: str, adapters: dict[str, Path]) -> w8a8.PeftDeltas:
    """The W8A8 truth on `base`'s experts: its FP8Experts tensors, else the checkpoint's.
    Refuses a format the truth lacks (per-channel scales) naming it."""
    quant = from_hf(base.config.to_dict(), name="model").quantization
    if quant.block is None or quant.method.value != "fp8_block":
        raise ConfigError(
            "quantization_config", quant.method.value, "fp8 with weight_block_size",
            "pass --no-check (the FP8 check covers block-scaled checkpoints)",
        )  # fmt: skip
    for name, path in adapters.items():
        _expert_only(name, path)
    layers = {}
    for index, layer in enumerate(base.model.layers):
        experts = layer.mlp.experts
        found = w8a8.fp8_layer_from_module(experts, quant.block)
        layers[index] = found or w8a8.fp8_layer_from_files(
            Path(model_dir), index, quant.block, experts.down_proj.device
        )
    return w8a8.install(base, layers, adapters)


def _expert_only(name: str, path: Path) -> None:
    """Refuse an adapter with LoRA outside the routed experts: the W8A8 truth adds PEFT's
    delta to the experts only."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as f:
        other = [k for k in f.keys() if ".lora_" in k and ".mlp.experts." not in k]
    if other:
        raise ConfigError(
            "--adapter", f"{name}={path}",
            f"LoRA on the routed experts only for the FP8 check (found {other[0]})",
            "pass --no-check, or check an experts-only adapter",
        )  # fmt: skip


def _noise(base, own: str, deltas, prompts) -> list[Noise]:
    """transformers' own FP8 experts (`own`) against the W8A8 truth on the base model,
    each row's prompt [S]; none where its FP8 kernels cannot run here."""
    worst = None
    for row, prompt in enumerate(prompts):
        truth = W8A8Truth(base, deltas, None)(input_ids=prompt[None]).logits[0].float()
        base.set_experts_implementation(own)
        try:  # the experts' noise: FP8 attention projections compute the truth's arithmetic
            with w8a8.fp8_linears_as_truth(base):
                theirs = base(input_ids=prompt[None]).logits[0].float()
        except Exception:  # transformers' FP8 kernels unavailable here: nothing to measure
            return []
        err = compare(theirs, truth, tol=float("inf")).rel_err
        if worst is None or not err <= worst.rel_err:  # NaN is kept: it must decide
            worst = Noise(f"{own} FP8 experts vs the W8A8 truth", err, row, None)
    return [worst]


def check(base, model_dir: str, adapters: dict[str, Path], batch, handle) -> CheckResult:
    """Each row of `batch` against the W8A8 truth alone, and the verdict."""
    own = base.config._experts_implementation or "grouped_mm"
    deltas = install_truth(base, model_dir, adapters)
    with torch.no_grad():
        noise = _noise(base, own, deltas, batch.prompts)
        logits = handle(batch.ids, adapter_names=batch.rows, attention_mask=batch.mask).logits
    checks = []
    width = batch.ids.shape[1]
    for row, (name, prompt) in enumerate(zip(batch.rows, batch.prompts)):
        mine = logits[row, width - len(prompt) :]
        truth = W8A8Truth(base, deltas, name)
        checks.append(check_row(truth, row, name, prompt, batch.new[row], mine, batch.pad))
    return CheckResult(checks, w8a8.NAME, noise, verdict(checks, torch.float8_e4m3fn, noise))
