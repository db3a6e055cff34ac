"""Outside truth for moelora inside transformers: a mixed batch (rows with different PEFT
adapters, base rows, left padding) generated through `moelora.hf.attach` equals, row by row,
HF + PEFT generating that row alone with its adapter (tokens equal, logits within the fp32
tolerance); base rows equal the model without adapters. Every family transformers and the
presets share; the reference backend on CPU (the triton backend: test_hf_triton.py)."""

from __future__ import annotations

import peft
import pytest
import torch
from hf_models import alone, assert_equals_alone, build_family, mixed_batch

from moelora.hf import attach, toy

pytestmark = pytest.mark.filterwarnings("ignore")
NEW_TOKENS = 5
# Row order: every adapter, base rows between, an adapter twice.
ROWS = ["fused-r8", None, "fused-r4-attn", "modules-r4", None, "fused-r2", "fused-r8"]


@pytest.fixture(scope="module", params=list(toy.FAMILIES))
def family(request, tmp_path_factory):
    return build_family(request.param, tmp_path_factory.mktemp(request.param), seed=1234)


def test_mixed_batch_generate_equals_peft_row_by_row(family, seed):
    model = family.fresh()
    handle = attach(model, num_slots=4, max_rank=16, moe_backend="reference")
    for name, path in family.dirs.items():
        handle.load_adapter(path, name=name, **family.load_kwargs)
    assert handle.adapters == sorted(family.dirs)
    batch = mixed_batch(handle, ROWS, NEW_TOKENS, torch.Generator().manual_seed(seed))
    changed = 0
    for row, (name, (prompt, _, real)) in enumerate(zip(ROWS, batch)):
        assert_equals_alone(family.truth(name), batch[row], NEW_TOKENS, f"row {row} ({name})")
        if name is not None:
            _, base_logits = alone(family.base, prompt, 0)
            changed += not torch.allclose(real, base_logits, atol=1e-3)
    assert changed == sum(n is not None for n in ROWS), "an adapter changed nothing"


def test_expert_weights_are_the_modules_own(family):
    """No second copy: each layer's w13 / w2 are views of the module's parameters (strided
    where transformers stores them transposed), and PEFT never wraps the experts."""
    model = family.fresh()
    handle = attach(model, num_slots=2, max_rank=8, moe_backend="reference")
    for path in family.dirs.values():
        handle.load_adapter(path, **family.load_kwargs)
    from moelora.hf import experts

    bound = [m for m in model.modules() if experts.key_of(m) is not None]
    assert len(bound) == len(handle.model_config.moe_layers)
    for module in bound:
        layer = experts.binding_of(module).layer
        w13 = getattr(module, "gate_up_proj", None)
        w13 = module.up_proj if w13 is None else w13
        for ours, theirs in ((layer.experts.w13, w13), (layer.experts.w2, module.down_proj)):
            assert ours.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
    wrappers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.ParamWrapper)]
    assert not wrappers, "PEFT must not fold the expert delta as well"
