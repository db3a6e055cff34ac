"""moelora.hf.attach on an FP8 checkpoint (block-scaled e4m3 experts, as transformers and the
published -FP8 checkpoints store them). transformers on a CPU loads the experts dequantized
to bf16 and drops the quantization_config: attach then serves the bf16 experts it holds, and
every row (base and adapters) equals transformers + PEFT on them. Where the config still
says FP8 but the experts were dequantized (a GPU below sm89), attach serves the
checkpoint's e4m3 experts and scales read from its files, W8A8 as transformers runs them on
a GPU that keeps them: every row equals transformers + PEFT with the experts' base GEMMs
fed quantized inputs (the LoRA part, PEFT's merged weight minus the base, the unquantized
ones)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quant_checkpoint import BLOCK_QC, quantize_experts_one

from moelora.compare import REL_TOL, assert_close, compare
from moelora.config import from_hf
from moelora.hf import attach, toy
from moelora.quant.fp8_experts import FP8ExpertWeights

pytestmark = pytest.mark.filterwarnings("ignore")


def _exact_experts(model, root) -> None:
    """transformers' experts set to the checkpoint's exact dequantization (it rounded them to
    bf16): the truth then runs the very weights moelora reads, so a routing decision near a
    tie cannot flip between the two (a 1e-3 weight change did, at seed 497803346)."""
    from moelora.quant.checkpoint import read_fp8_experts

    config = from_hf(model.config.to_dict(), "hf-fp8")
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            exact = read_fp8_experts(root, config, index).dequantize()
            layer.mlp.experts.gate_up_proj.copy_(exact.w13)
            layer.mlp.experts.down_proj.copy_(exact.w2)


TRUTH = "moelora_test_w8a8"  # the experts implementation of the W8A8 truth


def _w8a8_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager experts loop with W8A8 base GEMMs: each base GEMM input quantized
    by the format's groups (quant.activation_quant, checked against an fp64 loop in
    test_quant_reference), the LoRA part (PEFT's merged weight minus the base weight
    stored in `_truth_base`) on the unquantized rows."""
    from moelora.quant.activation_quant import base_gemm_input

    quant, (w13, w2) = self._truth_quant, self._truth_base
    out = torch.zeros_like(hidden_states)
    for e in range(w13.shape[0]):
        tok, pos = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue

        def linear(v, merged, base):
            return base_gemm_input(quant, v) @ base.t() + v @ (merged - base).t()

        gate, up = linear(hidden_states[tok], self.gate_up_proj[e], w13[e]).chunk(2, dim=-1)
        o = linear(self.act_fn(gate) * up, self.down_proj[e], w2[e])
        out.index_add_(0, tok, o * top_k_weights[tok, pos, None])
    return out


def _use_w8a8_truth(model) -> None:
    """The model's experts run _w8a8_experts on their present (base) weights."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(TRUTH, _w8a8_experts)
    quant = from_hf(model.config.to_dict(), "hf-fp8").quantization
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts._truth_quant = quant
        experts._truth_base = (
            experts.gate_up_proj.detach().clone(),
            experts.down_proj.detach().clone(),
        )
    model.set_experts_implementation(TRUTH)


def _assert_rows(out, ref, w8a8: bool, what: str) -> None:
    """out [B, S, V] equals ref to the fp32 tolerance, position by position. Under W8A8 one
    GEMM input element whose fp32 value differs between the two paths by summation order can
    sit on an e4m3 rounding boundary and round the other way (seed 1829365814: -0.0385283
    against -0.0385276 rounded to -0.0402 and -0.0369, moving one position by 1e-4); the
    flip moves its own position and, through attention, later ones of its sequence (seed
    1076362635: positions 0 and 1 of one row, 5e-4 and 4.6e-3). So the positions above the
    fp32 tolerance may then be those of one sequence, each within the table's FP8 row.
    out [S, V]: one sequence."""
    out, ref = out.reshape(-1, *out.shape[-2:]), ref.reshape(-1, *ref.shape[-2:])
    above = {
        b
        for b in range(out.shape[0])
        for o, r in zip(out[b], ref[b])
        if not compare(o, r, torch.float32).ok
    }
    if w8a8 and len(above) <= 1:
        assert all(compare(o, r, tol=REL_TOL[torch.float8_e4m3fn]).ok for o, r in
                   zip(out.flatten(0, -2), ref.flatten(0, -2))), f"{what}: rows {above}"  # fmt: skip
        return
    assert_close(out, ref, torch.float32, what=what)


def _fp8_checkpoint(tmp_path, seed: int):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, pad_token_id=0,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    model = from_hf(cfg.to_dict() | {"quantization_config": BLOCK_QC}, "hf-fp8")
    for key in [k for k in tensors if ".mlp.experts." in k]:
        tensors[key], tensors[key + "_scale_inv"] = quantize_experts_one(
            tensors[key].float().normal_(0, 0.2), model
        )
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": BLOCK_QC}))
    return AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()  # fp32: tight checks


@pytest.mark.parametrize("config_says_fp8", [False, True], ids=["cpu-dequantized", "fp8-config"])
def test_attach_serves_the_checkpoints_experts(tmp_path, seed, config_says_fp8):
    model = _fp8_checkpoint(tmp_path / "model", seed)
    assert getattr(model.config, "quantization_config", None) is None  # dropped on a CPU
    if config_says_fp8:  # as a GPU below sm89 keeps it
        model.config.quantization_config = dict(BLOCK_QC)
        _exact_experts(model, tmp_path / "model")
        _use_w8a8_truth(model)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32  # dequantized
    toy.write_peft_adapter(model, tmp_path / "a", seed=seed, r=4, lora_alpha=8,
                           target_parameters=toy.expert_parameters(model),
                           target_modules=["q_proj"])  # fmt: skip
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        base_ref = model(ids).logits
    import peft

    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(model, tmp_path / "a")
        lora_ref = peft_model(ids).logits
        model = peft_model.unload()
    handle = attach(model, num_slots=2, max_rank=8, moe_backend="reference")
    served = handle.layers[min(handle.layers)].experts  # the experts bound: FP8 weights served
    assert isinstance(served, FP8ExpertWeights) == config_says_fp8, type(served)
    handle.load_adapter(tmp_path / "a", name="a")
    with torch.no_grad():
        out = handle(ids, adapter_names=["a", None, "a"]).logits
    _assert_rows(out[[0, 2]], lora_ref[[0, 2]], config_says_fp8, "adapter rows")
    _assert_rows(out[1], base_ref[1], config_says_fp8, "base row")
    assert not torch.allclose(lora_ref[0], base_ref[0], atol=1e-3), "the adapter changes nothing"
