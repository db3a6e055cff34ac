"""The engine's CUDA-graph decode path (moelora/hf/step_graphs.py) on the CPU, with a
stand-in for the capture: buckets chosen per step, padding rows (slot -1, token 0,
position 0), every replay reading the same static buffers the capture read, steps with PEFT
rows run eagerly, warmup() capturing every bucket largest first; and the tokens equal HF +
PEFT alone. The real capture runs on the GPU (scripts/gpu_engine_check.py)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy_alone, run_all
from hf_models import build_family

from moelora import cuda_graphs
from moelora.engine import Engine, Request, Sampling, step_graphs
from moelora.errors import InputError
from moelora.hf import attach

pytestmark = pytest.mark.filterwarnings("ignore")

BUCKET_CASES = [
    # (max_rows, buckets): below the first power, between two, at 64, above 64
    (1, (1,)),
    (3, (1, 2, 3)),
    (8, (1, 2, 4, 8)),
    (64, (1, 2, 4, 8, 16, 32, 64)),
    (100, (1, 2, 4, 8, 16, 32, 64, 100)),
]


@pytest.mark.parametrize(("max_rows", "want"), BUCKET_CASES, ids=[str(c[0]) for c in BUCKET_CASES])
def test_buckets(max_rows, want):
    assert step_graphs.buckets_for(max_rows) == want
    graphs = step_graphs.StepGraphs(max_rows, step=lambda b: torch.zeros(b))
    for rows in range(1, max_rows + 1):
        b = graphs.bucket(rows)
        assert b >= rows and b in want and all(x < rows for x in want if x < b)


class StandIn:
    """Captures by running the step once and recording which static tensors its forward
    read; a replay checks the padding rows, runs the step again and asserts it read the
    very same tensors (a CUDA graph reads nothing else)."""

    def __init__(self, monkeypatch) -> None:
        self.captured: list[int] = []
        self.replays: list[int] = []
        self.engine: Engine | None = None
        monkeypatch.setattr(step_graphs, "capture", self.capture)

    def _pointers(self):
        e = self.engine
        return (e._ids.data_ptr(), e._positions.data_ptr(), e._slots.data_ptr(),
                e._token_slots.data_ptr(), e._write_rows.data_ptr(), e.cache.layers[0].keys.data_ptr())  # fmt: skip

    def capture(self, step, pool):
        bucket = len(step())
        self.captured.append(bucket)
        seen = self._pointers()
        out = step()

        def replay():
            self._check_padding(bucket)
            assert self._pointers() == seen, "a replay would read other tensors"
            out.copy_(step())
            self.replays.append(bucket)

        return step_graphs.Graph(replay, out)

    def _check_padding(self, bucket: int) -> None:
        e = self.engine
        busy = {r.row for r in e._rows.values()}
        for row in set(range(bucket)) - busy:
            assert e._slots[row] == -1 and e._ids[row, 0] == 0 and e._positions[row, 0] == 0
            assert e._write_rows[row, 0] == e.max_rows, "padding must write the spare row"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_family("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=7)


def _engine(qwen, stand_in, max_rows=8):
    handle = attach(qwen.fresh(), num_slots=4, max_rank=16, moe_backend="reference")
    for name, path in qwen.dirs.items():
        handle.load_adapter(path, name=name, **qwen.load_kwargs)
    engine = Engine(handle, max_rows=max_rows, max_len=32, enforce_eager=False)
    stand_in.engine = engine
    return engine


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(1, 96, (n,), generator=g).tolist())


def test_graph_decode_buckets_padding_and_tokens(qwen, seed, monkeypatch):
    """3 rows (bucket 4), a fourth joins (4), a fifth (8); rows with attention LoRA replay
    the same graphs (captured with every module the loaded adapters have LoRA on); every
    row equals HF + PEFT alone."""
    stand_in = StandIn(monkeypatch)
    engine = _engine(qwen, stand_in)
    plan = [("a", "fused-r8", 7), ("b", None, 9), ("c", "fused-r2", 6), ("d", "modules-r4", 5),
            ("e", None, 4), ("f", "fused-r4-attn", 6)]  # fmt: skip
    reqs = {rid: Request(rid, _prompt(seed + i, 3 + i), name, Sampling(max_new_tokens=n))
            for i, (rid, name, n) in enumerate(plan)}  # fmt: skip
    schedule = {0: [reqs["a"], reqs["b"], reqs["c"]], 2: [reqs["d"]], 3: [reqs["e"]]}
    got = run_all(engine, schedule)
    replays = len(stand_in.replays)
    got.update(
        run_all(
            engine,
            {0: [reqs["f"], Request("g", _prompt(seed, 4), None, Sampling(max_new_tokens=3))]},
        )
    )
    assert len(stand_in.replays) > replays, "steps with attention LoRA rows replay graphs too"
    assert got["g"][0] == greedy_alone(qwen.base, torch.tensor(_prompt(seed, 4)), 3)
    for rid, name, n in plan:
        want = greedy_alone(qwen.truth(name), torch.tensor(reqs[rid].prompt_ids), n)
        assert got[rid] == (want, "length"), rid
    # rows 0-2, then 0-3, then 0-4 busy; smaller buckets again as rows finish; never twice
    assert stand_in.captured[:2] == [4, 8]
    assert len(set(stand_in.captured)) == len(stand_in.captured)
    engine.close()


def test_warmup_captures_every_bucket_largest_first(qwen, seed, monkeypatch):
    stand_in = StandIn(monkeypatch)
    engine = _engine(qwen, stand_in, max_rows=6)
    inline = []  # per forward: (decode?, were the layers' own graphs off?)
    forward = Engine._forward

    def spy(self, ids, positions, masks, rows):
        inline.append((ids.shape[1] == 1, cuda_graphs.inlined()))
        return forward(self, ids, positions, masks, rows)

    monkeypatch.setattr(Engine, "_forward", spy)
    engine.add(Request("x", _prompt(seed, 4), None, Sampling(max_new_tokens=2)))
    with pytest.raises(InputError, match="running"):
        engine.warmup()
    run_all(engine)
    report = engine.warmup()
    assert stand_in.captured == [1, 6, 4, 2]  # x's step captured 1; warmup the rest
    assert report.buckets == (1, 2, 4, 6) and report.seconds >= 0
    got = run_all(
        engine, {0: [Request("y", _prompt(seed + 1, 5), "fused-r8", Sampling(max_new_tokens=4))]}
    )
    want = greedy_alone(qwen.truth("fused-r8"), torch.tensor(_prompt(seed + 1, 5)), 4)
    assert got["y"] == (want, "length") and stand_in.captured == [1, 6, 4, 2]
    # graphed decode steps run the layers inline (no per-layer graphs inside a step graph)
    assert {on for decode, on in inline if decode} == {True}
    assert {on for decode, on in inline if not decode} == {False}
    engine.close()


def test_handle_warmup_builds_the_threads_engine_and_captures_before_the_first_generate(
    qwen, seed, monkeypatch
):
    """handle.warmup(max_batch, max_length) captures every bucket up to max_batch at once;
    a generate of up to that size then captures nothing and equals HF + PEFT alone; bad
    sizes are refused naming the field."""
    stand_in = StandIn(monkeypatch)
    handle = attach(qwen.fresh(), num_slots=4, max_rank=16, moe_backend="reference",
                    enforce_eager=False)  # fmt: skip
    for name, path in qwen.dirs.items():
        handle.load_adapter(path, name=name, **qwen.load_kwargs)
    built = []
    monkeypatch.setattr(Engine, "warmup", _spying(Engine.warmup, built, stand_in))
    for field, args in (("max_batch", (0, 16)), ("max_length", (4, 1.5)),
                        ("max_length", (4, 10**9))):  # fmt: skip
        with pytest.raises(InputError, match=field):
            handle.warmup(*args)
    report = handle.warmup(5, 20)
    assert report.buckets == (1, 2, 4, 8) and stand_in.captured == [8, 4, 2, 1]
    (engine,) = built
    assert engine.max_rows == 8 and engine.max_len >= 20
    prompts = [_prompt(seed + i, 6) for i in range(3)]
    names = ["fused-r8", None, "fused-r2"]
    out = handle.generate(torch.tensor(prompts), adapter_names=names, max_new_tokens=4,
                          do_sample=False, pad_token_id=0)  # fmt: skip
    assert stand_in.captured == [8, 4, 2, 1] and stand_in.replays, "captured once, replayed"
    for row, (p, name) in enumerate(zip(prompts, names, strict=True)):
        want = greedy_alone(qwen.truth(name) if name else qwen.base, torch.tensor(p), 4)
        assert out[row, 6:].tolist() == want, row


def _spying(warmup, built: list, stand_in: StandIn):
    def spy(engine):
        built.append(engine)
        stand_in.engine = engine
        return warmup(engine)

    return spy
