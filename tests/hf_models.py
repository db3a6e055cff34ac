"""Test helpers for the transformers integration: a family's random model, its four PEFT
adapters saved by PEFT, HF + PEFT generating one row alone (the outside truth), left-padded
batches, and a mixed batch through a handle checked row by row against that truth."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moelora.compare import assert_close
from moelora.hf import toy

PAD = 0


@dataclass
class Family:
    model_type: str
    base: nn.Module  # never attached: the outside truth without adapters
    peft_models: dict[str, nn.Module]  # name -> PEFT model with that adapter alone
    dirs: dict[str, Path]

    @property
    def load_kwargs(self) -> dict:
        """Non-gated fused files read both ways: these were saved by PEFT 0.21 ("natural")."""
        return {"fused_orientation": "natural"} if self.model_type == "nemotron_h" else {}

    def fresh(self) -> nn.Module:
        """A copy of the base model to attach moelora to."""
        return copy.deepcopy(self.base)

    def truth(self, name: str | None) -> nn.Module:
        return self.base if name is None else self.peft_models[name]


def build_family(model_type: str, root: Path, seed: int) -> Family:
    base = toy.build_model(model_type, seed=seed)
    models, dirs = {}, {}
    for i, (name, kw) in enumerate(toy.demo_adapters(base).items()):
        dirs[name] = root / name
        models[name] = toy.write_peft_adapter(base, dirs[name], seed=seed + 17 * i + 1, **kw)
    return Family(model_type, base, models, dirs)


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, S], attention_mask [B, S]) with PAD on the left of shorter prompts."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    return ids, mask


def prompts(count: int, vocab: int, gen: torch.Generator, lengths=(5, 9)) -> list[torch.Tensor]:
    """Random prompts of different lengths (no PAD token inside)."""
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=gen).tolist()
    sizes[0], sizes[-1] = lengths  # the batch is padded for sure
    return [torch.randint(1, vocab, (n,), generator=gen) for n in sizes]


def alone(
    model: nn.Module, prompt: torch.Tensor, new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(generated token ids [new_tokens], prompt logits [S, V]) of one row on its own."""
    with torch.no_grad():
        logits = model(input_ids=prompt[None]).logits[0]
        if new_tokens == 0:
            return prompt.new_empty(0), logits
        out = model.generate(
            input_ids=prompt[None], max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD
        )
    return out[0, len(prompt) :], logits


def mixed_batch(
    handle, names: list[str | None], new_tokens: int, gen: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random prompts, left-padded into one batch whose row i runs adapter names[i] (None: the
    base model), through handle.generate (greedy) and one handle forward. Per row: (prompt
    [S_i], its generated ids [new_tokens], the logits of the prompt's own positions [S_i, V])."""
    rows = prompts(len(names), handle.model.config.vocab_size, gen)
    ids, mask = left_padded(rows)
    out = handle.generate(
        ids, adapter_names=names, attention_mask=mask, max_new_tokens=new_tokens,
        do_sample=False, pad_token_id=PAD,
    )  # fmt: skip
    logits = handle(ids, adapter_names=names, attention_mask=mask).logits
    width = ids.shape[1]
    return [(p, out[row, width:], logits[row, width - len(p) :]) for row, p in enumerate(rows)]


def assert_equals_alone(truth: nn.Module, row: tuple, new_tokens: int, what: str) -> None:
    """One row of a mixed batch, (prompt, tokens, logits) as mixed_batch gives it, equals
    `truth` (HF + PEFT) generating that prompt alone: the new_tokens tokens equal, the
    prompt's logits [S, V] within the fp32 tolerance."""
    prompt, tokens, logits = row
    want_tokens, want_logits = alone(truth, prompt, new_tokens)
    assert torch.equal(tokens, want_tokens), f"{what}: {tokens} != {want_tokens}"
    assert_close(logits, want_logits, torch.float32, what=f"{what} logits")
