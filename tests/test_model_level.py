"""The model-level benchmark (moelora/bench/model_level.py, `moelora bench --model-level`; its
model, moelora/bench/qwen3_model.py):
its directly written adapter files have PEFT's own keys and shapes and load to the factors
PEFT's save_pretrained files give, and a tiny CPU run reports every configuration with sane
numbers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moelora.bench import model_level
from moelora.bench import qwen3_model as ml
from moelora.hf.toy import write_peft_adapter

SMALL = ml.Shape(2, vocab=256, hidden=64, inter=32, experts=8, top_k=2, heads=4, kv_heads=2,
                 head_dim=16)  # fmt: skip


@pytest.mark.parametrize("attention", [False, True], ids=["experts-only", "with-qkvo"])
def test_written_adapter_has_peft_layout(tmp_path, attention):
    """Same keys and shapes as PEFT 0.21's save_pretrained for the same targets."""
    model = ml.build_model(SMALL, "cpu", torch.float32)
    mine = load_file(str(ml.write_adapter(tmp_path / "mine", SMALL, 4, attention, seed=3)
                         / "adapter_model.safetensors"))  # fmt: skip
    targets = list(ml.ATTENTION) if attention else []
    write_peft_adapter(model, tmp_path / "peft", seed=1, r=4, lora_alpha=8,
                       target_modules=targets,
                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert {k: list(v.shape) for k, v in mine.items()} == {
        k: list(v.shape) for k, v in theirs.items()
    }
    assert all(v.abs().sum() > 0 for v in mine.values())  # random, never a no-op adapter


def test_written_adapter_loads(tmp_path):
    from moelora.config import from_hf
    from moelora.lora import load_adapter

    path = ml.write_adapter(tmp_path / "a", SMALL, 4, False, seed=5)
    adapter = load_adapter(path, from_hf(SMALL.hf_config().to_dict()), 8)
    assert sorted(adapter.layers) == [0, 1] and adapter.rank == 4


def test_step_bytes_counts_touched_experts():
    model = ml.build_model(SMALL, "cpu", torch.float32)
    one, many = ml.step_bytes(model, SMALL, 1, 16), ml.step_bytes(model, SMALL, 512, 16)
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".mlp.experts." in n)
    # batch 1 reads K of E experts; a huge batch reads all of them (plus its KV cache)
    assert one < many and experts * SMALL.top_k / SMALL.experts < one


def test_tiny_cpu_run_reports_every_config(tmp_path):
    out = tmp_path / "rows.json"
    rows = model_level.main(["--small", "--layers", "2", "--batches", "1,3", "--prompt", "6",
                             "--new", "4", "--repeats", "1", "--adapters", "2",
                             "--attention-adapters", "1", "--rank", "4", "--device", "cpu",
                             "--json", str(out)])  # fmt: skip
    decode = [r for r in rows if r["kind"] == "decode"]
    assert {(r["config"], r["batch"]) for r in decode} == {
        (c, b)
        for c in ("hf_eager", "moelora_free", "moelora_experts", "moelora_attention")
        for b in (1, 3)
    }
    for r in decode:
        assert r["decode_tok_s"] > 0 and r["ttft_ms"] > 0 and r["prefill_tok_s"] > 0
    start = next(r for r in rows if r["kind"] == "startup")
    assert start["adapters"] == ["e0", "e1", "q0"]
    assert start["triton_compiled"] == 0  # a CPU run compiles no kernel
    phases = {r["phase"]: r["s"] for r in rows if r["kind"] == "phase"}
    assert list(phases) == ["write_adapters", "hf_peft_truth", "check", "batch_1", "batch_3"]
    assert all(s >= 0 for s in phases.values()) and phases["batch_1"] > 0, phases
    assert json.loads(out.read_text()) == rows


def test_decode_rate_between_two_generates_that_both_decode():
    """Decode tokens/s comes from a short and a long generate (the same prefill, the same
    decode path): the rate is the tokens between them over their time difference."""
    import argparse

    # each generate: a prefill of 0.5 s give or take up to 0.1 s, then 0.01 s per decode step
    spread = {1: 0.1, 16: -0.1, 64: 0.0}
    seen = []
    times = iter([0.5 + spread[n] + 0.01 * (n - 1) for _ in range(2) for n in (1, 16, 64)])

    class FakeClock:
        cuda = False

        def time(self, call, ids, n):
            seen.append(int(ids[0, 0]))
            return next(times)

        def time_and_peak(self, call, ids, n):
            seen.append(int(ids[0, 0]))
            return next(times), 1.0

    rows, drawn = [], iter(range(100))

    def prompts():  # a batch of 4 prompts of 8 tokens, new each time
        return torch.full((4, 8), float(next(drawn)))

    a = argparse.Namespace(new=64, repeats=1, prompt=8)
    model_level._measure_batch(a, {"x": None}, prompts, None,
                               lambda **r: rows.append(r), FakeClock())  # fmt: skip
    (r,) = rows  # warm-up then one timed pass: 1, 16 and 64 tokens each time
    # 48 steps of 4 rows over their 0.48 s plus the two prefills' 0.1 s difference (a
    # one-token generate against the long one would read 63 x 4 / (0.63 - 0.1))
    assert r["decode_tok_s"] == round(4 * 48 / (0.48 + 0.1), 1)
    assert r["ttft_ms"] == 600.0
    # every generate on prompts of its own: none can read another's from the prefix cache
    assert len(seen) == 6 and len(set(seen)) == 6
    with pytest.raises(SystemExit):
        model_level.parse(["--new", "2"])


def test_memory_bound_is_each_configs_peak_over_weights_banks_and_kv():
    rows = [dict(kind="model", params_gib=50.0),
            dict(kind="startup", attach_gib=8.0, kv_gib=2.0),
            dict(kind="decode", config="hf_eager", batch=1, peak_gib=99.0),
            dict(kind="decode", config="moelora_free", batch=1, peak_gib=61.0),
            dict(kind="decode", config="moelora_free", batch=64, peak_gib=63.0),
            dict(kind="decode", config="moelora_experts", batch=1, peak_gib=66.0)]  # fmt: skip
    got = model_level.memory_bound(rows)
    assert got["weights_banks_kv_gib"] == 60.0
    assert got["peak_gib"] == {"moelora_free": 63.0, "moelora_experts": 66.0}
    assert got["of_bound"] == {"moelora_free": 1.05, "moelora_experts": 1.1}
    rows[1]["attach_gib"] = None  # a CPU run: no device figure, no bound
    assert model_level.memory_bound(rows) is None


def test_moelora_bench_model_level_runs_it_and_refuses_the_layer_suites_options(tmp_path, capsys):
    from moelora.cli import main as cli

    out = tmp_path / "rows.json"
    args = ["--small", "--layers", "2", "--batches", "2", "--prompt", "5", "--new", "3",
            "--repeats", "1", "--adapters", "1", "--attention-adapters", "1", "--rank", "2",
            "--device", "cpu", "--json", str(out)]  # fmt: skip
    assert cli(["bench", "--model-level", *args]) == 0
    rows = json.loads(out.read_text())
    assert {r["config"] for r in rows if r["kind"] == "decode"} == {
        "hf_eager", "moelora_free", "moelora_experts", "moelora_attention"}  # fmt: skip
    assert cli(["bench", "--suite", "mixtral", "--json", "x.json", "--model-level", *args]) == 2
    err = capsys.readouterr().err
    assert "--suite, --json before --model-level" in err and "Fix:" in err, err
    with pytest.raises(SystemExit) as done:
        cli(["bench", "--model-level", "--configs", "hf_eager,nope"])
    assert done.value.code == 2 and "--configs: unknown ['nope']" in capsys.readouterr().err


def test_hf_static_generates_eager_tokens_with_one_cache_length(monkeypatch):
    """hf_static hands generate a StaticCache of prompt + --new for every length it is asked
    for (one compile a batch on CUDA), and generates what hf_eager does."""
    from transformers import StaticCache

    made = []
    init = StaticCache.__init__

    def spy(self, *args, **kw):  # on the class: transformers' lazy package hands out its own
        made.append(kw["max_cache_len"])
        init(self, *args, **kw)

    monkeypatch.setattr(StaticCache, "__init__", spy)
    model = ml.build_model(SMALL, "cpu", torch.float32)
    ids = torch.randint(1, SMALL.vocab, (2, 6), generator=torch.Generator().manual_seed(4))
    eager = model_level._call_for("hf_eager", model, None, {}, 6 + 5)
    static = model_level._call_for("hf_static", model, None, {}, 6 + 5)
    for new in (1, 2, 5):
        assert torch.equal(static(ids, new), eager(ids, new))
    assert made == [11, 11, 11]


def test_triton_entries_are_the_kernel_cache_folders(tmp_path, monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path / "cache"))
    assert model_level._triton_entries() == set()  # no cache folder yet
    (tmp_path / "cache" / "AB12").mkdir(parents=True)
    (tmp_path / "cache" / "CD34").mkdir()
    assert model_level._triton_entries() == {"AB12", "CD34"}
