"""Test helpers for the decode engine: drive an Engine to the end, record the logits each
request's tokens were picked from, and the outside truth of one row (HF + PEFT alone)."""

from __future__ import annotations

from collections import defaultdict

import torch

from moelora.engine import Engine, Request
from moelora.engine import engine as engine_module


class LogitsLog:
    """Wraps the engine's next_tokens: request id -> logits [V] of each of its tokens."""

    def __init__(self, monkeypatch) -> None:
        self.by_request: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._current: list[str] = []
        real = engine_module.next_tokens
        original_accept = Engine._accept

        def accept(engine, rows, logits):
            self._current = [r.request.request_id for r in rows]
            return original_accept(engine, rows, logits)

        def record(logits, rows, generated):
            for rid, row_logits in zip(self._current, logits):
                self.by_request[rid].append(row_logits.detach().float().clone())
            return real(logits, rows, generated)

        monkeypatch.setattr(engine_module, "next_tokens", record)
        monkeypatch.setattr(Engine, "_accept", accept)


def run_all(engine: Engine, schedule: dict[int, list[Request]] | None = None, cancel=None):
    """Step until no work: schedule[k] are added before step k, cancel[k] ids cancelled
    before step k. Returns request id -> (tokens, finish reason)."""
    schedule, cancel = schedule or {}, cancel or {}
    tokens: dict[str, list[int]] = defaultdict(list)
    reasons: dict[str, str] = {}
    step = 0
    while engine.has_work or any(k >= step for k in schedule):
        for request in schedule.get(step, []):
            engine.add(request)
        for rid in cancel.get(step, []):
            engine.cancel(rid)
        for event in engine.step():
            assert event.request_id not in reasons, f"{event.request_id}: event after finish"
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
            if event.finished:
                reasons[event.request_id] = event.finish_reason
        step += 1
        assert step < 500, "the engine never finished"
    return {rid: (tokens[rid], reasons[rid]) for rid in reasons}


def truth_logits(model, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """logits [n, V] the model gives for each of `tokens` (n = len(tokens)), from one forward
    over prompt + tokens[:-1]."""
    ids = torch.cat([prompt, torch.tensor(tokens[:-1], dtype=prompt.dtype)])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1 :]


def greedy_alone(model, prompt: torch.Tensor, new_tokens: int, **kwargs) -> list[int]:
    """HF generate of one row alone (greedy unless kwargs say otherwise)."""
    kwargs.setdefault("do_sample", False)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt[None], max_new_tokens=new_tokens, pad_token_id=0, **kwargs
        )
    return out[0, len(prompt) :].tolist()


def run_paged(engine: Engine, arrivals, cancels: dict[str, int], limit: int = 400):
    """Step a paged engine until every request finished: arrivals [(step, request)] queue at
    their step and join while admissible() agrees (as the server's scheduler adds them),
    cancels {request id: step}; after every step the pool's books agree and its used blocks
    are the rows' (a shared block counted once). Returns (tokens, finish reasons) by id."""
    queue, tokens, reasons = [], defaultdict(list), {}
    for step in range(limit):
        queue += [r for at, r in arrivals if at == step]
        while queue and engine.admissible(queue[0]) is None:
            engine.add(queue.pop(0))
        for rid, at in cancels.items():
            if at == step:
                engine.cancel(rid)
        for event in engine.step():
            assert event.error is None, event
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
            if event.finished:
                reasons[event.request_id] = event.finish_reason
        engine.pool.check()
        assert engine.pool.used == len({b for r in engine._rows.values() for b in r.blocks})
        if len(reasons) == len(arrivals):
            break
    assert len(reasons) == len(arrivals), (reasons, queue)
    return tokens, reasons


def tiny_qwen_with_adapters(root, model_seed: int, adapter_seed: int):
    """A tiny Qwen3-MoE model and two PEFT adapters written under root: "every" (every
    Linear, the LM head and the experts) and "attn" (q / v only). (base, truths by adapter
    name with None the base, directories by name)."""
    from moelora.hf import toy

    base = toy.build_model("qwen3_moe", seed=model_seed)
    linears = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
    kinds = {
        "every": dict(r=4, lora_alpha=8, target_modules=linears,
                      target_parameters=toy.expert_parameters(base)),
        "attn": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    }  # fmt: skip
    truths, dirs = {None: base}, {}
    for i, (name, kw) in enumerate(kinds.items()):
        dirs[name] = root / name
        truths[name] = toy.write_peft_adapter(base, dirs[name], seed=adapter_seed + i, **kw)
    return base, truths, dirs


# Qwen3.5-MoE as published, in small: linear-attention (Gated DeltaNet) layers around a
# gated full-attention one, two value heads per key head (toy.build_model overrides)
QWEN35 = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
              "linear_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)  # fmt: skip


def runner_engine(made, **kw) -> Engine:
    """An engine on the runner (eager unless kw says otherwise) over a copy of made's base
    model (made: (base, truths, directories by adapter name)) with every adapter of `made`
    loaded."""
    import copy

    from moelora.hf import attach

    base, _, dirs = made
    handle = attach(copy.deepcopy(base), num_slots=2, max_rank=8, moe_backend="reference")
    for name, path in dirs.items():
        handle.load_adapter(path, name=name)
    return Engine(handle, **(dict(enforce_eager=True, runner=True) | kw))
