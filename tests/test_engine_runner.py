"""The decode runner (moelora/engine/runner.py) on the CPU, its kernels through Triton's
interpreter: rows of a continuously batched run decoded by the runner equal HF + PEFT
generating each row alone (tokens equal; the logits each token was picked from within the
fp32 tolerance of the exact ones, HF + PEFT in float64, or twice HF's fp32 distance from
them where that is larger), with adapters on every LoRA module the runner serves (q / k / v / o,
the router where PEFT can target it (not gpt-oss's), the LM head, the experts) and rows without, for each family it knows (Qwen3-MoE,
OLMoE, Mixtral, gpt-oss with a sliding-window layer and attention sinks, DeepSeek-V2 and V3
with latent attention, a dense layer, shared experts and grouped routing, Llama 4 with
chunked attention, a NoPE layer's attention temperature and a dense layer, Qwen3.5-MoE with
linear-attention layers); configurations and families it does not know are refused when asked for
and left to transformers' forward otherwise."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import QWEN35, LogitsLog, greedy_alone, run_all, truth_logits

from moelora.compare import NOISE_FACTOR, REL_TOL, assert_close, compare
from moelora.engine import Engine, Request, Sampling
from moelora.errors import ConfigError
from moelora.hf import attach, toy

pytestmark = pytest.mark.filterwarnings("ignore")
NEW = 5


def _adapters(model) -> dict[str, dict]:
    # every Linear the family has (DeepSeek: MLA's projections, the shared experts' and the
    # dense layers' MLPs); not Llama 4's router, a Linear subclass returning (scores, logits)
    # that PEFT's LoRA wrapper cannot run
    linears = sorted({n.split(".")[-1] for n, m in model.named_modules()
                      if type(m) is torch.nn.Linear})  # fmt: skip
    # gpt-oss's router is not a Linear, nor a router PEFT knows; nor is Qwen3.5's (PEFT
    # refuses Qwen3_5MoeTopKRouter as a target): no router LoRA there
    routers = [n for n, m in model.named_modules()
               if n.endswith(".mlp.gate") and "Qwen3_5" not in type(m).__name__]  # fmt: skip
    experts = toy.expert_parameters(model)
    return {
        "every-module": dict(r=4, lora_alpha=8, target_modules=linears + routers,
                             target_parameters=experts, rank_pattern={"o_proj": 2}),
        "attention-only": dict(r=3, lora_alpha=6, use_rslora=True, target_modules=[
            n for n in ("q_proj", "v_proj", "q_b_proj", "kv_b_proj") if n in linears]),
        "experts-only": dict(r=2, lora_alpha=4, target_parameters=experts),
    }  # fmt: skip


FAMILIES = [
    "qwen3_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3", "llama4_text",
    "qwen3_5_moe_text",
]  # fmt: skip
# gpt-oss as published: sliding-window layers between full ones; a window of 4 positions
# is shorter than every prompt here, so prefill and decode both cut it. DeepSeek-V3 as
# published: q through q_a / q_b, interleaved rotary pairs, a dense first layer, shared
# experts, grouped routing (test_deepseek_without_q_lora... covers q_proj and rotate_half)
# Llama 4 as published, in small: chunked attention on its rotary layers (chunks of 4
# positions: prompts and decodes cross them), a NoPE layer with attention temperature
# (floor_scale 2: it changes every other position), a dense layer between MoE ones
OVERRIDES = {"gpt_oss": dict(layer_types=["sliding_attention", "full_attention"],
                             sliding_window=4),
             "deepseek_v3": dict(q_lora_rank=6, rope_interleave=True),
             "llama4_text": dict(num_hidden_layers=3, moe_layers=[0, 2],
                                 no_rope_layers=[1, 0, 1], attention_chunk_size=4,
                                 floor_scale=2),
             "qwen3_5_moe_text": QWEN35}  # fmt: skip


@pytest.fixture(scope="module", params=FAMILIES)
def qwen(request, tmp_path_factory):
    """A tiny model of each family the runner knows, with PEFT adapters written for it."""
    root = tmp_path_factory.mktemp("runner")
    base = toy.build_model(request.param, seed=31, **OVERRIDES.get(request.param, {}))
    truths, dirs = {}, {}
    for i, (name, kw) in enumerate(_adapters(base).items()):
        dirs[name] = root / name
        truths[name] = toy.write_peft_adapter(base, dirs[name], seed=40 + i, **kw)
    return base, truths, dirs


def _handle(qwen):
    import copy

    base, _, dirs = qwen
    handle = attach(copy.deepcopy(base), num_slots=3, max_rank=8, moe_backend="reference")
    for name, path in dirs.items():
        handle.load_adapter(path, name=name)
    return handle


ROWS = ["every-module", None, "attention-only", "experts-only", "every-module"]


def test_runner_rows_equal_hf_peft_alone(qwen, seed, monkeypatch):
    base, truths, _ = qwen
    engine = Engine(_handle(qwen), max_rows=6, max_len=40, enforce_eager=True, runner=True)
    assert engine.runner is not None
    log = LogitsLog(monkeypatch)
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(1, 96, (n,), generator=g).tolist()) for n in (4, 7, 5, 9, 6)]
    requests = [Request(f"r{i}", p, name, Sampling(max_new_tokens=NEW))
                for i, (name, p) in enumerate(zip(ROWS, prompts))]  # fmt: skip
    got = run_all(engine, {0: requests[::2], 2: requests[1::2]})  # rows join mid-run
    for i, (name, prompt) in enumerate(zip(ROWS, prompts)):
        truth = base if name is None else truths[name]
        tokens, reason = got[f"r{i}"]
        assert (tokens, reason) == (greedy_alone(truth, torch.tensor(prompt), NEW), "length"), i
        out = torch.stack(log.by_request[f"r{i}"])
        ref = truth_logits(truth, torch.tensor(prompt), tokens)
        exact, tol = _exact(truth, prompt, tokens, ref)
        assert_close(out.double(), exact, tol=tol, what=f"row {i} ({name}) logits")
    engine.close()


def _exact(truth, prompt: tuple[int, ...], tokens: list[int], ref: torch.Tensor):
    """(the exact logits: the same model and adapter in float64, the tolerance): the fp32
    table's, or twice HF's own distance (ref, fp32) from the exact logits where that is
    larger. Against the exact result, not HF's fp32 one: on a prompt where a layer amplifies
    fp32 rounding, two fp32 implementations each near the exact result can be twice as far
    from each other (Qwen3.5's linear-attention layers: the runner 6.0e-6 and HF 5.8e-6 from
    the exact logits, 1.16e-5 apart, against the table's 1e-5)."""
    import copy

    model = copy.deepcopy(truth).double()
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    hf.set_experts_implementation("eager")  # (grouped_mm takes no float64)
    exact = truth_logits(model, torch.tensor(prompt), tokens)
    noise = compare(ref.double(), exact, tol=float("inf")).rel_err
    assert noise == noise, "HF's own logits are NaN"
    return exact, max(REL_TOL[torch.float32], NOISE_FACTOR * noise)


def test_runner_equals_the_models_own_forward(qwen, seed, monkeypatch):
    """The same requests through the runner and through transformers' forward (the engine's
    other decode path): equal tokens, logits within the fp32 tolerance, every step. Where
    transformers' forward cannot batch the family (Llama 4's NoPE layers scale q by one
    length per batch; Qwen3.5's linear-attention layers keep state the engine's forward
    path does not), the engine refuses that path naming the runner
    (test_runner_rows_equal_hf_peft_alone covers the runner's rows)."""
    handle = _handle(qwen)
    refused = {"llama4_text": "temperature", "qwen3_5_moe_text": "linear_attention"}
    why = refused.get(qwen[0].config.model_type)
    if why is not None:
        with pytest.raises(ConfigError, match=f"{why}.*runner=True"):
            Engine(handle, max_rows=4, max_len=32, enforce_eager=True, runner=False)
        return
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(1, 96, (n,), generator=g).tolist()) for n in (3, 8, 6)]
    names = ["every-module", "experts-only", None]
    _runner_against_forward(handle, prompts, names, monkeypatch)


def _runner_against_forward(handle, prompts, names, monkeypatch) -> None:
    """The same requests through the runner and through transformers' forward: logits
    within the fp32 tolerance, every step of every row."""
    logs = {}
    for runner in (True, False):
        log = LogitsLog(monkeypatch)
        engine = Engine(handle, max_rows=4, max_len=32, enforce_eager=True, runner=runner)
        assert (engine.runner is not None) == runner
        reqs = [Request(f"{runner}{i}", p, n, Sampling(max_new_tokens=NEW))
                for i, (n, p) in enumerate(zip(names, prompts))]  # fmt: skip
        run_all(engine, {0: reqs})
        logs[runner] = [torch.stack(log.by_request[r.request_id]) for r in reqs]
        engine.close()
        monkeypatch.undo()
    for i, (out, ref) in enumerate(zip(logs[True], logs[False])):
        assert_close(out, ref, torch.float32, what=f"row {i}")


def test_deepseek_without_q_lora_and_with_rotate_half_equals_the_models_own_forward(
    tmp_path, seed, monkeypatch
):
    """DeepSeek-V3's other layout (q_proj, no q_a / q_b; rotary over halves, not pairs):
    the runner's rows equal transformers' forward's, with LoRA on MLA's projections."""
    base = toy.build_model("deepseek_v3", seed=5, q_lora_rank=None, rope_interleave=False)
    kw = dict(r=4, lora_alpha=8, target_modules=["q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
              "o_proj", "gate_proj", "up_proj", "down_proj"],
              target_parameters=toy.expert_parameters(base))  # fmt: skip
    toy.write_peft_adapter(base, tmp_path / "mla", seed=9, **kw)
    handle = attach(base, num_slots=2, max_rank=8, moe_backend="reference")
    handle.load_adapter(tmp_path / "mla", name="mla")
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(1, 96, (n,), generator=g).tolist()) for n in (6, 3)]
    _runner_against_forward(handle, prompts, ["mla", None], monkeypatch)


def test_deepseek_caches_latents_and_absorbs_an_fp8_kv_b_dequantized(seed, monkeypatch):
    """The latent cache: one row of rank + rope numbers a position and layer (values a view
    of it, counted once), against heads x 2 x (nope + rope) expanded. kv_b_proj as
    transformers' block-scaled FP8Linear: the runner absorbs its dequantized weight, so its
    rows equal transformers' forward of the same model with kv_b the dense dequantized
    Linear (e4m3 x its fp32 scale is exact in fp32), every step within the fp32 table."""
    import copy

    from test_fp8_linear import fp8_module

    from moelora.engine.paged_cache import bytes_per_block

    g = torch.Generator().manual_seed(seed)
    fp8 = toy.build_model("deepseek_v3", seed=int(torch.randint(1000, (1,), generator=g)),
                          kv_lora_rank=32)  # fmt: skip
    dense = copy.deepcopy(fp8)
    for fp8_layer, dense_layer in zip(fp8.model.layers, dense.model.layers):
        kv_b = fp8_layer.self_attn.kv_b_proj
        module = fp8_module(kv_b.out_features, kv_b.in_features, (16, 32), False,
                            torch.float32, g)  # fmt: skip
        scale = module.weight_scale_inv.repeat_interleave(16, 0).repeat_interleave(32, 1)
        fp8_layer.self_attn.kv_b_proj = module
        dense_layer.self_attn.kv_b_proj.weight.data = module.weight.float() * scale[
            : kv_b.out_features, : kv_b.in_features]  # fmt: skip
    config, attn = fp8.config, fp8.model.layers[0].self_attn
    width = attn.kv_lora_rank + attn.qk_rope_head_dim
    assert bytes_per_block(fp8, 4, torch.float32) == config.num_hidden_layers * width * 4 * 4
    prompts = [tuple(torch.randint(1, 96, (n,), generator=g).tolist()) for n in (6, 3)]
    logs = {}
    for runner, model in ((True, fp8), (False, dense)):
        handle = attach(model, num_slots=2, max_rank=8, moe_backend="reference")
        log = LogitsLog(monkeypatch)
        engine = Engine(handle, max_rows=4, max_len=32, enforce_eager=True, runner=runner,
                        block_size=4)  # fmt: skip
        assert (engine.runner is not None) == runner
        if runner:
            layer = engine.cache.layers[0]
            assert layer.keys.shape[1:] == (1, 4, width)
            assert layer.values.data_ptr() == layer.keys.data_ptr()
            assert layer.values.shape[-1] == attn.kv_lora_rank
            assert engine.cache.nbytes() == engine.cache.num_blocks * bytes_per_block(
                fp8, 4, torch.float32)  # fmt: skip
        reqs = [Request(f"{runner}{i}", p, None, Sampling(max_new_tokens=NEW))
                for i, p in enumerate(prompts)]  # fmt: skip
        run_all(engine, {0: reqs})
        logs[runner] = [torch.stack(log.by_request[r.request_id]) for r in reqs]
        engine.close()
        handle.detach()
        monkeypatch.undo()
    for i, (out, ref) in enumerate(zip(logs[True], logs[False])):
        assert torch.isfinite(out).all()
        assert_close(out, ref, torch.float32, what=f"row {i}")


def test_deepseeks_latent_cache_through_preemption_prefix_hits_and_chunks(tmp_path, seed,
                                                                         monkeypatch):  # fmt: skip
    """DeepSeek-V3 on the paged latent cache with LoRA on every MLA projection: rows that run
    out of blocks are preempted and recomputed, prompts are prefilled in chunks of 5 tokens
    after the cached positions, a prompt whose leading blocks a same-adapter request cached
    reads them (fewer tokens prefilled); every row equals HF + PEFT generating it alone."""
    from engine_helpers import runner_engine

    g = torch.Generator().manual_seed(seed)
    base = toy.build_model("deepseek_v3", seed=int(torch.randint(1000, (1,), generator=g)))
    kw = dict(r=4, lora_alpha=8, target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
              "kv_b_proj", "o_proj"], target_parameters=toy.expert_parameters(base))  # fmt: skip
    truth = toy.write_peft_adapter(base, tmp_path / "mla", seed=seed % 1000, **kw)
    made = (base, {None: base, "mla": truth}, {"mla": tmp_path / "mla"})
    engine = runner_engine(made, max_rows=4, max_len=20, block_size=4, num_blocks=8,
                           max_num_batched_tokens=5)  # fmt: skip
    sizes, real = [], engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill",
                        lambda *a, **k: sizes.append(int(a[0].shape[0])) or real(*a, **k))  # fmt: skip
    prompts = [tuple(torch.randint(1, 96, (n,), generator=g).tolist()) for n in (9, 7, 11, 10)]
    names = ["mla", None, "mla", "mla"]
    requests = [Request(f"r{i}", p, n, Sampling(max_new_tokens=5))
                for i, (p, n) in enumerate(zip(prompts, names))]  # fmt: skip
    first = Request("first", prompts[0], "mla", Sampling(max_new_tokens=2))
    again = Request("again", (*prompts[0], 3, 4), "mla", Sampling(max_new_tokens=4))
    for r in (first, again):  # the second reads the first's two full blocks
        want = greedy_alone(truth, torch.tensor(r.prompt_ids), r.sampling.max_new_tokens)
        assert run_all(engine, {0: [r]})[r.request_id] == (want, "length")
    assert engine.pool.stats.hits == 8 and sizes == [5, 4, 3]
    got = run_all(engine, {0: requests[:2], 1: requests[2:]})
    assert engine.preemptions > 0 and max(sizes) <= 5
    for r in requests:
        want = greedy_alone(made[1][r.adapter], torch.tensor(r.prompt_ids), 5)
        assert got[r.request_id] == (want, "length"), r.request_id
    engine.pool.check()
    engine.close()


def test_a_family_the_runner_does_not_know_is_refused_or_left_to_transformers(tmp_path):
    model = toy.build_model("nemotron_h", seed=3)  # Mamba layers: the runner has none
    handle = attach(model, num_slots=2, max_rank=8, moe_backend="reference")
    with pytest.raises(ConfigError, match="nemotron_h"):
        Engine(handle, max_rows=2, max_len=16, enforce_eager=True, runner=True)
    model = toy.build_model("olmoe", seed=3, clip_qkv=8.0)  # a configuration it does not know
    handle = attach(model, num_slots=2, max_rank=8, moe_backend="reference")
    with pytest.raises(ConfigError, match="clip_qkv"):
        Engine(handle, max_rows=2, max_len=16, enforce_eager=True, runner=True)
    engine = Engine(handle, max_rows=2, max_len=16, enforce_eager=True)  # default: not asked
    assert engine.runner is None
    engine.close()


def test_prompts_of_any_lengths_prefill_in_one_varlen_runner_forward(qwen, seed, monkeypatch):
    """Waiting prompts of different lengths go through one packed runner prefill; a row
    asking for prompt logprobs runs apart and its logprobs equal HF + PEFT's log_softmax of
    its prompt, every position."""
    base, truths, _ = qwen
    engine = Engine(_handle(qwen), max_rows=6, max_len=40, enforce_eager=True, runner=True)
    calls = []
    prefill = engine.runner.prefill

    def spy(*args, **kw):  # (ids, positions, write_rows, lengths, cache_rows, rows, cache,
        # table, every), pos0=
        calls.append((list(args[3]), args[8]))
        return prefill(*args, **kw)

    monkeypatch.setattr(engine.runner, "prefill", spy)
    g = torch.Generator().manual_seed(seed)
    lengths = (3, 11, 6, 8)
    prompts = [tuple(torch.randint(1, 96, (n,), generator=g).tolist()) for n in lengths]
    names = ["every-module", None, "attention-only", "every-module"]
    requests = [
        Request(f"p{i}", p, n, Sampling(max_new_tokens=2, prompt_logprobs=3 if i == 3 else None))
        for i, (n, p) in enumerate(zip(names, prompts))
    ]
    for r in requests:
        engine.add(r)
    tokens, firsts = {r.request_id: [] for r in requests}, {}
    for _ in range(10):
        for event in engine.step():
            assert event.error is None, event.error
            tokens[event.request_id].append(event.token_id)
            firsts.setdefault(event.request_id, event)
        if not engine.has_work:
            break
    assert sorted(calls) == sorted([([3, 11, 6], False), ([8], True)]), calls
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        truth = base if name is None else truths[name]
        assert tokens[f"p{i}"] == greedy_alone(truth, torch.tensor(prompt), 2), i
    got = firsts["p3"].prompt_logprobs  # sent with the row's first token
    with torch.no_grad():
        logits = truths["every-module"](torch.tensor([prompts[3]])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)
    assert got[0] is None and len(got) == len(prompts[3])
    for i, entry in enumerate(got[1:], start=1):
        want = ref[i - 1]
        assert entry.token == prompts[3][i]
        assert abs(entry.logprob - float(want[entry.token])) < 1e-4, (i, entry.logprob)
        top = [t for t, _ in entry.top]
        assert top == want.topk(3).indices.tolist(), i
    engine.close()


def test_a_long_prompt_prefills_in_chunks_beside_running_decodes(qwen, seed, monkeypatch):
    """max_num_batched_tokens 5: a 13-token prompt arriving while a row decodes is
    prefilled in chunks of 4 in the same forward as the running row's token (vLLM V1's
    unified batch: 5 tokens a step), each chunk reading the ones before from the cache; the
    running row gets a token every step meanwhile, and every row equals HF + PEFT alone."""
    _, truths, _ = qwen
    engine = Engine(_handle(qwen), max_rows=4, max_len=40, enforce_eager=True, runner=True,
                    max_num_batched_tokens=5)  # fmt: skip
    forwards = []  # each runner forward's sequence lengths, by step
    prefill = engine.runner.prefill

    def spy(*args, **kw):  # (ids, positions, write_rows, lengths, ...)
        forwards.append((len(per_step), list(args[3])))
        return prefill(*args, **kw)

    monkeypatch.setattr(engine.runner, "prefill", spy)
    g = torch.Generator().manual_seed(seed)
    short = tuple(torch.randint(1, 96, (4,), generator=g).tolist())
    long = tuple(torch.randint(1, 96, (13,), generator=g).tolist())
    first = Request("short", short, "every-module", Sampling(max_new_tokens=8))
    second = Request("long", long, "attention-only", Sampling(max_new_tokens=3))
    per_step = []
    engine.add(first)
    for step in range(20):
        if step == 2:
            engine.add(second)
        events = engine.step()
        assert all(e.error is None for e in events), events
        per_step.append({e.request_id: e.token_id for e in events if e.token_id >= 0})
        if not engine.has_work:
            break
    # step 0 the short prompt; steps 2-5 the running row's token and a chunk of the long one
    assert forwards == [(0, [4]), (2, [1, 4]), (3, [1, 4]), (4, [1, 4]), (5, [1, 1])], forwards
    assert all("short" in per_step[k] for k in (2, 3, 4, 5)), per_step
    assert all("long" not in per_step[k] for k in (2, 3, 4)) and "long" in per_step[5], per_step
    for request, name in ((first, "every-module"), (second, "attention-only")):
        got = [step[request.request_id] for step in per_step if request.request_id in step]
        want = greedy_alone(truths[name], torch.tensor(request.prompt_ids), len(got))
        assert got == want and len(got) == request.sampling.max_new_tokens, request.request_id
    engine.close()


def test_a_served_module_the_runner_would_not_apply_refuses_the_runner(qwen, monkeypatch):
    """Every module attach() serves LoRA on must be one the runner applies, else the rows
    would lose that LoRA: asked for, the runner is refused naming the module."""
    from moelora.engine import runner as runner_module

    real = runner_module.DecodeRunner._paths
    monkeypatch.setattr(runner_module.DecodeRunner, "_paths",
                        lambda self: real(self) - {"lm_head"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"LoRA served on \['lm_head'\]"):
        Engine(_handle(qwen), max_rows=2, max_len=16, enforce_eager=True, runner=True)


def test_compile_ahead_pass_reads_no_kernel_output_as_an_index(qwen, monkeypatch):
    """Engine.warmup's compile-ahead pass runs every step with its kernels recorded, not run
    (kernels/compile_ahead.py): their outputs hold whatever memory held. On the GPU a torch
    op indexing with such an output could fault, so here every tensor the launchers allocate
    in the pass is poisoned (floats NaN, ints 2**30, out of any range): the pass must finish
    (a torch op indexing with one raises on the CPU), leave the KV cache and the
    linear-attention states as they were (no kernel ran; what the steps' torch ops write
    into the null block and the spare row is put back), and every family record launches."""
    from types import SimpleNamespace

    from moelora.engine.mixed_graphs import MixedGraphs
    from moelora.kernels import compile_ahead

    engine = Engine(_handle(qwen), max_rows=6, max_len=40, enforce_eager=True, runner=True)
    engine.graphs = SimpleNamespace(buckets=(1, 2, 4, 6))  # the decode buckets a GPU captures
    engine.mixed = None if engine.runner.linear else MixedGraphs(engine, 24)
    state = [t for layer in engine.cache.layers if layer for t in (layer.keys, layer.values)]
    state += [t for s in engine.cache.states.values() for t in (s.conv, s.recurrent)]
    for t in state:  # a sentinel no poisoned output equals
        t.copy_(torch.rand(t.shape, generator=torch.Generator().manual_seed(5)) + 3)
    before = [t.clone() for t in state]
    launches = []
    monkeypatch.setattr(compile_ahead, "wanted", lambda device: True)
    monkeypatch.setattr(compile_ahead, "compile_all", launches.extend)

    def poisoned(make):
        def made(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan") if t.is_floating_point() else 2**30 if t.dtype not in (
                torch.bool, torch.uint8, torch.int8) else 1)  # fmt: skip

        return made

    real = compile_ahead.recording

    def recording(on_launch):  # what the launchers allocate with, poisoned for the pass only
        monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
        monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
        monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))
        return real(on_launch)

    monkeypatch.setattr(compile_ahead, "recording", recording)
    recorded = engine._compile_ahead(engine.handle.lora_modules)
    monkeypatch.undo()
    assert recorded > 0 and launches, "the pass failed (see the warning) or recorded nothing"
    assert all(torch.equal(t, b) for t, b in zip(state, before)), "the pass wrote the cache"
    names = {fn.fn.__name__ for fn, _, _ in launches}
    assert {"_add_rms_norm_kernel", "_router_topk_kernel"} & names, names
    engine.close()
