"""handle.generate on the decode engine: the tensor model.generate returns (left-padded
input, new tokens, pad after a row's stop), each row equal to HF + PEFT generating it alone
with the same settings; settings and models the engine does not implement run
model.generate (its output, and one log line saying why)."""

from __future__ import annotations

import logging

import pytest
import torch
from hf_models import PAD, build_family, left_padded, prompts

from moelora.engine import generate as engine_generate
from moelora.hf import attach, toy

pytestmark = pytest.mark.filterwarnings("ignore")
ROWS = ["fused-r8", None, "fused-r4-attn", "modules-r4", None]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_family("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=31)


def _handle(family):
    handle = attach(family.fresh(), num_slots=4, max_rank=16, moe_backend="reference")
    for name, path in family.dirs.items():
        handle.load_adapter(path, name=name, **family.load_kwargs)
    return handle


def _alone(model, prompt, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=prompt[None], do_sample=False, pad_token_id=PAD, **kwargs)
    return out[0, len(prompt) :].tolist()


CASES = [
    # (id, generate kwargs besides the mask; "eos" is filled with a token a row reaches)
    ("max_new_tokens", dict(max_new_tokens=5)),
    ("max_length", dict(max_length=14)),  # 14 - width new tokens
    ("eos-stops-rows", dict(max_new_tokens=6, eos_token_id="eos")),
    ("min_new_tokens", dict(max_new_tokens=6, eos_token_id="eos", min_new_tokens=4)),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_generate_equals_rows_alone(qwen, seed, kwargs, monkeypatch):
    handle = _handle(qwen)
    used = []
    real_run = engine_generate._run
    monkeypatch.setattr(engine_generate, "_run", lambda e, r: used.append(len(r)) or real_run(e, r))
    rows = prompts(len(ROWS), 96, torch.Generator().manual_seed(seed))
    ids, mask = left_padded(rows)
    if kwargs.get("eos_token_id") == "eos":  # the third token row 0 would produce
        kwargs = {
            **kwargs,
            "eos_token_id": _alone(qwen.truth(ROWS[0]), rows[0], max_new_tokens=3)[2],
        }
    out = handle.generate(ids, adapter_names=ROWS, attention_mask=mask, pad_token_id=PAD, **kwargs)
    assert used == [len(ROWS)], "the engine did not decode this call"
    alone_kwargs = dict(kwargs)
    if "max_length" in alone_kwargs:  # the row alone is shorter: the same number of new tokens
        alone_kwargs = {"max_new_tokens": kwargs["max_length"] - ids.shape[1]}
    want = [_alone(qwen.truth(n), p, **alone_kwargs) for n, p in zip(ROWS, rows)]
    width = max(len(w) for w in want)
    assert out.shape == (len(ROWS), ids.shape[1] + width)
    assert torch.equal(out[:, : ids.shape[1]], ids)
    for row, w in enumerate(want):
        assert out[row, ids.shape[1] :].tolist() == w + [PAD] * (width - len(w)), f"row {row}"
    if "eos_token_id" in kwargs and "min_new_tokens" not in kwargs:
        assert want[0][-1] == kwargs["eos_token_id"] and len(want[0]) < 6  # row 0 stopped
    if "min_new_tokens" in kwargs:  # its eos at the third token was not taken
        assert len(want[0]) >= kwargs["min_new_tokens"]


def test_unsupported_settings_run_model_generate(qwen, seed, caplog, monkeypatch):
    """Beams: model.generate's own output for base rows (the model without adapters)."""
    handle = _handle(qwen)
    monkeypatch.setattr(engine_generate, "_logged", set())
    ids, mask = left_padded(prompts(3, 96, torch.Generator().manual_seed(seed)))
    with caplog.at_level(logging.INFO, logger="moelora.engine"):
        out = handle.generate(
            ids, attention_mask=mask, max_new_tokens=4, num_beams=2, pad_token_id=PAD
        )
    with torch.no_grad():
        want = qwen.base.generate(
            ids, attention_mask=mask, max_new_tokens=4, num_beams=2, pad_token_id=PAD
        )
    assert torch.equal(out, want)
    assert "model.generate: generation setting num_beams = 2" in caplog.text


def test_models_with_other_state_run_model_generate(seed, caplog, monkeypatch):
    """NemotronH with a Mamba layer: the engine cannot keep its state, model.generate runs."""
    base = toy.build_model("nemotron_h", hybrid_override_pattern="M*E", seed=seed % 1000)
    model = toy.build_model("nemotron_h", hybrid_override_pattern="M*E", seed=seed % 1000)
    handle = attach(model, num_slots=2, max_rank=8, moe_backend="reference")
    monkeypatch.setattr(engine_generate, "_logged", set())
    ids, mask = left_padded(prompts(2, 96, torch.Generator().manual_seed(seed)))
    with caplog.at_level(logging.INFO, logger="moelora.engine"):
        out = handle.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=PAD)
    with torch.no_grad():
        want = base.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=PAD)
    assert torch.equal(out, want)
    assert "linear_attention" in caplog.text and "model.generate" in caplog.text
