"""An FP8 checkpoint on the decode runner: block-scaled e4m3 experts (transformers' FP8Experts
kept, as on a GPU >= sm89), attention, router and LM head in the serving dtype. The experts
run on moelora's W8A8 layer on both of the engine's paths, so the runner's rows equal the
rows of transformers' forward on the same engine, every step (fp32: tokens equal, logits
within the e4m3 row of the tolerance table, _both_paths says why), with experts-only
adapters and without; a checkpoint whose
attention projections are quantized modules is refused by name."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import LogitsLog, greedy_alone, run_all, truth_logits

from benchmarks.fp8_checkpoint import write_fp8_checkpoint
from benchmarks.fp8_generate import TINY, write_adapters
from moelora.bench.qwen3_model import build
from moelora.compare import assert_close
from moelora.engine import Engine, Request, Sampling
from moelora.engine.runner import runner_support
from moelora.errors import ConfigError
from moelora.hf import attach

pytestmark = pytest.mark.filterwarnings("ignore")
NEW = 4


def _both_paths(handle, names, prompts, joined: int):
    """The same requests (names[i] on prompts[i], the first `joined` at step 0, the rest
    at step 1) through the runner and through transformers' forward on `handle`: tokens
    equal, every step's logits within the e4m3 row of the tolerance table; (tokens, logits)
    by path (True: the runner). Not fp32's row: both paths quantize the W8A8 layers' inputs
    to e4m3, and the ~1e-7 by which the paths' fp32 attention differs moves an input across
    a rounding boundary now and then (seed 1260842922 / model seed 571: one step of one row
    at 6.1e-5, every other step at most 7.7e-7)."""
    logs, tokens = {}, {}
    for runner in (True, False):
        with pytest.MonkeyPatch.context() as logged:
            log = LogitsLog(logged)
            engine = Engine(handle, max_rows=4, max_len=24, enforce_eager=True, runner=runner)
            assert (engine.runner is not None) == runner
            reqs = [Request(f"{runner}{i}", p, n, Sampling(max_new_tokens=NEW))
                    for i, (n, p) in enumerate(zip(names, prompts))]  # fmt: skip
            got = run_all(engine, {0: reqs[:joined], 1: reqs[joined:]})
            tokens[runner] = [got[r.request_id] for r in reqs]
            logs[runner] = [torch.stack(log.by_request[r.request_id]) for r in reqs]
            engine.close()
    assert tokens[True] == tokens[False]
    for i, (out, ref) in enumerate(zip(logs[True], logs[False])):
        assert torch.isfinite(out).all()
        assert_close(out, ref, torch.float8_e4m3fn, what=f"row {i} ({names[i]})")
    return tokens, logs


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory, model_seed):
    """transformers' FP8 model of a 2-layer checkpoint (its FP8Experts kept on the CPU), in
    fp32 but the e4m3 experts, and two experts-only PEFT adapters."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    root = tmp_path_factory.mktemp("fp8-runner")
    model = build(2, "cpu", model_seed, **TINY).float()
    adapters = write_adapters(model, root / "adapters", 2, 4, 0.2)
    write_fp8_checkpoint(model, root / "model", 32, "per_expert")
    keep = pytest.MonkeyPatch()
    keep.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda *a, **k: None)
    try:
        base = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    finally:
        keep.undo()
    assert type(base.model.layers[0].mlp.experts).__name__ == "FP8Experts"
    assert base.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    return base, adapters


def test_fp8_experts_rows_on_the_runner_equal_transformers_forward(fp8_model, seed):
    base, adapters = fp8_model
    handle = attach(base, num_slots=2, max_rank=8, moe_backend="triton")
    for name, path in adapters.items():
        handle.load_adapter(path, name=name)
    assert runner_support(base) == []
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(1, 96, (n,), generator=g).tolist()) for n in (5, 3)]
    prompts.append(prompts[0])  # the base model on the first adapter's prompt
    names = [*adapters, None]
    _, logs = _both_paths(handle, names, prompts, joined=2)
    # the adapter moves its row from the base model's on the same prompt (so the rows the
    # check compares carry the adapters' expert LoRA, not only the base experts)
    moved = (logs[True][0] - logs[True][2]).norm() / logs[True][2].norm()
    assert moved > 0.1, moved  # ~1.3 at lora std 0.2


def test_quantized_attention_projections_are_refused_by_name(fp8_model):
    import copy

    base, _ = fp8_model
    model = copy.deepcopy(base)

    class FP8Linear(torch.nn.Linear):  # the name transformers' quantized Linear has
        pass

    old = model.model.layers[1].self_attn.o_proj
    model.model.layers[1].self_attn.o_proj = FP8Linear(old.in_features, old.out_features, False)
    (reason,) = runner_support(model)
    assert "FP8Linear" in reason and "plain nn.Linear" in reason
    handle = attach(model, num_slots=1, max_rank=4, moe_backend="triton")
    with pytest.raises(ConfigError, match="FP8Linear"):
        Engine(handle, max_rows=2, max_len=16, enforce_eager=True, runner=True)


# ---- FP8 attention projections (transformers' FP8Linear), W8A8 on the runner ----------


def _quantize_attention(model, block) -> None:
    """q / k / v / o of every layer replaced by transformers' FP8Linear holding the weight
    quantized per square block (benchmarks/fp8_checkpoint.quantize_block: each block's amax
    to 448), in place."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from benchmarks.fp8_checkpoint import quantize_block

    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            old = getattr(attn, name)
            module = FP8Linear(old.in_features, old.out_features, block_size=block)
            with torch.no_grad():
                w, scale = quantize_block(old.weight.detach().float(), block[0])
            module.weight.data, module.weight_scale_inv.data = w, scale
            setattr(attn, name, module)


@pytest.fixture(scope="module")
def fp8_attention(tmp_path_factory, model_seed):
    """A tiny Qwen3-MoE whose attention projections are FP8Linear (block 32 x 32), their
    forward the truth's arithmetic (transformers' own kernels come from the Hub), and PEFT
    adapters with attention LoRA written on the full-precision model before."""
    import copy

    import peft

    from moelora.hf import toy

    root = tmp_path_factory.mktemp("fp8-attention")
    base = toy.build_model("qwen3_moe", seed=model_seed)
    experts = toy.expert_parameters(base)
    kinds = {
        "attention+experts": dict(r=4, lora_alpha=8, target_parameters=experts,
                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "q-v-only": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    }  # fmt: skip
    dirs = {}
    for i, (name, kw) in enumerate(kinds.items()):
        dirs[name] = root / name
        toy.write_peft_adapter(base, dirs[name], seed=model_seed + i + 1, **kw)
    _quantize_attention(base, (32, 32))
    truths = {name: peft.PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
              for name, path in dirs.items()}  # fmt: skip
    truths[None] = copy.deepcopy(base)
    return base, dirs, truths


def test_fp8_attention_rows_on_the_runner_equal_transformers_forward(fp8_attention, seed,
                                                                    monkeypatch):  # fmt: skip
    """The runner's W8A8 projections (kernels/fp8_linear.py) against HF + PEFT generating
    each row alone (copies made before attach: their FP8Linear computes the truth's torch
    arithmetic, PEFT's LoRA wrapping it on its unquantized input), and against
    transformers' forward on the same engine (whose FP8Linear modules run moelora's kernel
    while attached: that comparison covers the rest of the step): equal tokens, fp32
    logits, every step, adapters with q / k / v / o LoRA beside the base model."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from moelora.truth import w8a8

    base, dirs, truths = fp8_attention
    monkeypatch.setattr(FP8Linear, "forward", w8a8.fp8_linear)
    handle = attach(base, num_slots=2, max_rank=8, moe_backend="reference")
    for name, path in dirs.items():
        handle.load_adapter(path, name=name)
    assert runner_support(base) == []
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(1, 96, (n,), generator=g).tolist()) for n in (6, 4, 5)]
    names = [*dirs, None]
    tokens, logs = _both_paths(handle, names, prompts, joined=1)
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        got, reason = tokens[True][i]
        alone = greedy_alone(truths[name], torch.tensor(prompt), NEW)
        assert (got, reason) == (alone, "length"), (i, name)
        ref = truth_logits(truths[name], torch.tensor(prompt), got)
        assert_close(logs[True][i], ref, torch.float32, what=f"row {i} ({name}) vs HF + PEFT")
