"""Steps with prompt chunks replayed from CUDA graphs of their bucket of tokens
(moelora/engine/mixed_graphs.py), on the CPU with a stand-in for the capture (kernels through
Triton's interpreter): prompts arriving while rows decode, each step's tokens padded up to
its bucket (padding: token 0, slot -1, the spare block-table row, positions inside max_len),
and every row still equal to HF + PEFT generating it alone; a bucket whose capture fails
runs eagerly from then on, rows still exact; warmup() captures the token buckets. The real
capture runs on the GPU (scripts/gpu_engine_check.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import greedy_alone, run_all, tiny_qwen_with_adapters

from moelora.engine import Engine, Request, Sampling, mixed_graphs, step_graphs
from moelora.hf import attach

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize(
    ("tokens", "decoding", "want"),
    [
        (528, 16, 512),  # 16 rows beside a 512-token chunk: not the 1024 bucket, half padding
        (512, 16, 512),  # a bucket exactly
        (164, 64, 164),  # small buckets cost about the same: the padding is cheaper
        (1100, 64, 1024),
        (1900, 64, 1900),  # little padding in the 2048 bucket
        (130, 128, 130),  # the bucket below holds no prompt token
        (3000, 0, 3000),  # past the largest bucket: eager, no padding
    ],
)
def test_fit_to_bucket(tokens, decoding, want):
    assert mixed_graphs.fit_to_bucket(mixed_graphs.BUCKETS, tokens, decoding) == want


def test_a_chunk_beside_decodes_is_cut_to_fill_a_bucket(made, seed, monkeypatch):
    """Buckets of 8 / 16 / 32 tokens (and no fixed step cost): four rows decoding beside
    a prompt capped at 14 tokens a step (18 tokens) run the 16 bucket with a 12-token chunk,
    then 8 with 4, then the last 2 tokens unpadded; every row equals HF + PEFT alone."""
    monkeypatch.setattr(mixed_graphs, "BUCKETS", (8, 16, 32))
    monkeypatch.setattr(mixed_graphs, "STEP_FIXED_TOKENS", 0)
    stand_in = StandIn(monkeypatch)
    engine = _engine(made, stand_in, budget=40, long_prefill_token_threshold=14)
    assert engine.mixed.buckets == (8, 16, 32)
    totals, real = [], engine.mixed.run
    monkeypatch.setattr(engine.mixed, "run", lambda prompts, *a: totals.append(
        sum(len(p) for p in prompts)) or real(prompts, *a))  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    short = [Request(f"s{i}", tuple(torch.randint(1, 96, (3,), generator=g).tolist()), name,
                     Sampling(max_new_tokens=7)) for i, name in enumerate(["every", None] * 2)]  # fmt: skip
    long = Request("long", tuple(torch.randint(1, 96, (18,), generator=g).tolist()), "attn",
                   Sampling(max_new_tokens=3))  # fmt: skip
    got = run_all(engine, {0: short, 2: [long]})
    assert totals[-3:] == [4 + 12, 4 + 4, 4 + 2], totals  # the long prompt's three steps
    for r in [*short, long]:
        want = greedy_alone(
            made[1][r.adapter], torch.tensor(r.prompt_ids), r.sampling.max_new_tokens
        )
        assert got[r.request_id] == (want, "length"), r.request_id
    engine.pool.check()
    engine.close()


@pytest.mark.parametrize(
    ("budget", "want"),
    [(32, (32,)), (128, (128,)), (300, (128, 256, 300)), (8192, mixed_graphs.BUCKETS)],
)
def test_token_buckets(budget, want):
    assert mixed_graphs.buckets_for(budget) == want


class StandIn:
    """Captures by running the step twice (warm-up, capture); a replay checks the padding in
    the prompt-step buffers and runs the step again into the captured output."""

    def __init__(self, monkeypatch) -> None:
        self.engine: Engine | None = None
        self.prompt_replays = 0
        self.fail_next = False
        monkeypatch.setattr(step_graphs, "capture", self.capture)

    def capture(self, step, pool):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("operation not permitted when stream is capturing")
        step()
        out = step()
        mixed = self.engine.mixed
        prompt_step = out.shape[0] == mixed.sequences

        def replay():
            if prompt_step:
                self._check_padding(mixed)
                self.prompt_replays += 1
            out.copy_(step())

        return step_graphs.Graph(replay, out)

    def _check_padding(self, mixed) -> None:
        pad = mixed.write_rows == mixed.spare
        assert (mixed.ids[pad] == 0).all() and (mixed.slots[pad] == -1).all()
        assert (mixed.positions[pad] < mixed.max_len).all()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return tiny_qwen_with_adapters(tmp_path_factory.mktemp("mixed"), 41, 60)


def _engine(made, stand_in, budget: int = 20, **kw) -> Engine:
    base, _, dirs = made
    handle = attach(copy.deepcopy(base), num_slots=2, max_rank=8, moe_backend="reference")
    for name, path in dirs.items():
        handle.load_adapter(path, name=name)
    engine = Engine(handle, enforce_eager=False, runner=True, max_rows=5, max_len=24,
                    block_size=4, max_num_batched_tokens=budget, **kw)  # fmt: skip
    stand_in.engine = engine
    return engine


def _requests(seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    names = ["every", None, "attn", "every", None]
    lengths = [6, 9, 5, 13, 3]
    return [Request(f"r{i}", tuple(torch.randint(1, 96, (n,), generator=g).tolist()), name,
                    Sampling(max_new_tokens=5)) for i, (n, name) in enumerate(zip(lengths, names))]  # fmt: skip


def _check_rows(made, requests, got) -> None:
    for r in requests:
        want = greedy_alone(made[1][r.adapter], torch.tensor(r.prompt_ids), 5)
        assert got[r.request_id] == (want, "length"), r.request_id


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 (latent attention: the prompt steps' varlen table is built for all
    its query heads over one latent head) with "every" and "attn" adapters."""
    from moelora.hf import toy

    root = tmp_path_factory.mktemp("mixed_mla")
    base = toy.build_model("deepseek_v3", seed=43)
    mla = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    kinds = {"every": dict(r=4, lora_alpha=8, target_modules=mla,
                           target_parameters=toy.expert_parameters(base)),
             "attn": dict(r=2, lora_alpha=4, target_modules=["q_b_proj", "kv_b_proj"])}  # fmt: skip
    truths, dirs = {None: base}, {}
    for i, (name, kw) in enumerate(kinds.items()):
        dirs[name] = root / name
        truths[name] = toy.write_peft_adapter(base, dirs[name], seed=70 + i, **kw)
    return base, truths, dirs


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_prompt_steps_replay_their_bucket_and_rows_stay_exact(family, request, seed,
                                                              monkeypatch):  # fmt: skip
    """Prompts join while rows decode (a 13-token one chunked past the 20-token budget):
    every step with a chunk replays the prompt-step graph, and every row equals HF + PEFT
    alone."""
    made = request.getfixturevalue("made" if family == "qwen3_moe" else "deepseek")
    stand_in = StandIn(monkeypatch)
    engine = _engine(made, stand_in)
    requests = _requests(seed)
    got = run_all(engine, {0: requests[:2], 2: requests[2:4], 4: requests[4:]})
    assert stand_in.prompt_replays >= 3
    _check_rows(made, requests, got)
    engine.pool.check()
    engine.close()


def test_a_bucket_whose_capture_fails_runs_eagerly_and_rows_stay_exact(made, seed, monkeypatch):
    stand_in = StandIn(monkeypatch)
    engine = _engine(made, stand_in)
    stand_in.fail_next = True  # the first capture: the first prompt step's
    requests = _requests(seed + 1)
    got = run_all(engine, {0: requests[:2], 2: requests[2:4], 4: requests[4:]})
    assert stand_in.prompt_replays == 0, "the failed bucket must not be captured again"
    assert engine.mixed._eager
    _check_rows(made, requests, got)
    engine.close()


def test_warmup_captures_the_token_buckets(made, monkeypatch):
    stand_in = StandIn(monkeypatch)
    engine = _engine(made, stand_in)
    report = engine.warmup()
    assert report.prompt_buckets == (20,) and "prompt steps: [20] tokens" in str(report)
    assert engine.mixed.graphs.captured == (20,)
    engine.close()


def test_warmup_compiles_every_steps_kernels_ahead_and_rows_stay_exact(made, seed, monkeypatch):
    """warmup() first runs every decode and prompt step once with its kernels recorded, not
    launched (kernels/compile_ahead.py; the compile itself needs a GPU: compile_all is a
    stand-in here): the launches of every bucket reach compile_all, the recording pass
    leaves the KV cache as it was, and rows after it equal HF + PEFT."""
    from moelora.kernels import compile_ahead

    stand_in = StandIn(monkeypatch)
    engine = _engine(made, stand_in)
    handed = []
    monkeypatch.setattr(compile_ahead, "wanted", lambda device: True)
    monkeypatch.setattr(compile_ahead, "compile_all", lambda launches: handed.extend(launches))
    ran = []
    for obj, name in ((engine, "_graph_step"), (engine.mixed, "step")):
        step = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda b, m, step=step: ran.append(b) or step(b, m))
    layers = engine.cache.layers
    for layer in layers:  # a sentinel no unlaunched kernel's output equals
        layer.keys.fill_(7.0)
        layer.values.fill_(7.0)
    recorded = engine._compile_ahead(engine.handle.lora_modules)
    assert recorded > len(handed) > 0  # the layers' launches alike: kept once
    for layer in layers:  # nothing ran: nothing written (padding steps write the null blocks)
        assert (layer.keys == 7.0).all() and (layer.values == 7.0).all()
    assert ran == [*engine.graphs.buckets, *engine.mixed.buckets]  # every step warmup captures
    names = {fn.fn.__name__ for fn, _, _ in handed}
    assert {"_decode_attention_kernel", "_prefill_attention_kernel", "_rope_cache_kernel",
            "_add_rms_norm_kernel"} <= names, names  # fmt: skip
    for layer in layers:  # a cache as the engine keeps it, for the rows below
        layer.keys.zero_()
        layer.values.zero_()
    count = len(handed)
    handed.clear()
    engine.warmup()  # the recording pass, then the captures
    assert len(handed) == count
    requests = _requests(seed + 2)
    got = run_all(engine, {0: requests[:2], 2: requests[2:4], 4: requests[4:]})
    _check_rows(made, requests, got)
    engine.close()
