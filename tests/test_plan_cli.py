"""`moelora plan` through moelora.cli.main: exit codes (0 accepted, 3 refused, 2 bad usage),
the table, --json, and vLLM flag semantics."""

from __future__ import annotations

import json
import logging

import pytest
from oracle_doubles import LORA_ONLY, MIMIC

from moelora import cli
from moelora.backends import registry as registry_mod
from moelora.backends.checks import CHECKS
from moelora.commands.flag_terms import VLLM_LORA_FLAGS, in_flag_terms
from moelora.presets import preset_dict


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = plan(capsys, *argv, "--json")
    return code, json.loads(out)


@pytest.fixture
def mimic_first(monkeypatch):
    """Register the test-only vendor mimic (ranked first) and a LoRA-only kernel, this test only."""
    registry = {"lora_only": LORA_ONLY, "mimic": MIMIC, **registry_mod.REGISTRY}
    monkeypatch.setattr(registry_mod, "REGISTRY", registry)
    return registry


QWEN_TP4_LORA = ("--model", "qwen3-30b-a3b", "-tp", "4", "--enable-lora", "--device", "h200")


def test_accepted_prints_every_backend_by_every_check_and_a_verdict(capsys, caplog):
    caplog.set_level(logging.INFO, logger="moelora.oracle")
    code, out, _ = plan(capsys, *QWEN_TP4_LORA)
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("check "))
    assert header.split()[1:] == list(registry_mod.REGISTRY)
    for name, _ in CHECKS:
        assert any(line.split()[0] == name for line in lines if line.strip())
    assert lines[-1] == "verdict: ACCEPTED: triton, auto: the fastest that runs here"
    # The selection is said once: the verdict; the oracle's log line only under -v.
    assert not [r for r in caplog.records if r.name == "moelora.oracle"]
    # grouped_mm and reference refuse (CUDA graphs): their validation is not "yes" there
    [validated] = [line.split()[2:] for line in lines if line.startswith("validated here")]
    assert validated == ["yes", "-", "-"], out
    assert cli.main(["-v", "plan", *QWEN_TP4_LORA]) == 0
    [line] = [r.getMessage() for r in caplog.records if r.name == "moelora.oracle"]
    assert line.startswith("moe backend for qwen3-30b-a3b: selected triton, auto")


def test_json_is_complete_and_parseable(capsys):
    code, plan_ = plan_json(capsys, *QWEN_TP4_LORA)
    assert code == 0 and plan_["accepted"] is True and plan_["error"] is None
    assert plan_["selected"] in registry_mod.REGISTRY
    assert plan_["how"] == "auto"
    assert [b["name"] for b in plan_["backends"]] == list(registry_mod.REGISTRY)
    for backend in plan_["backends"]:
        assert [c["check"] for c in backend["checks"]] == [name for name, _ in CHECKS]
        assert backend["accepts"] == all(c["ok"] for c in backend["checks"])
    dep = plan_["deployment"]
    assert (dep["intermediate_per_partition"], dep["tp"], dep["cuda_graphs"]) == (192, 4, True)


def test_explicit_mimic_with_fully_sharded_lora_is_refused_at_plan_time(capsys, mimic_first):
    argv = ("--model", "qwen3.5-35b-a3b", "-tp", "2", "--enable-lora", "--fully-sharded-loras",
            "--lora-add-inputs", "overwrite", "--device", "sm103", "--enforce-eager",
            "--moe-backend", "mimic")  # fmt: skip
    code, out, _ = plan(capsys, *argv)
    assert code == 3
    verdict = out.splitlines()[-1]
    # issue 18.3: the sharding is what fails, not add_inputs
    assert verdict.startswith(
        "verdict: REFUSED: mimic cannot run it (lora.sharding = fully_sharded"
    )
    assert verdict.endswith("would accept: lora_only, triton, reference")  # triton: since fs
    code, plan_ = plan_json(capsys, *argv)
    assert code == 3 and plan_["accepted"] is False and plan_["selected"] is None
    [mimic] = [b for b in plan_["backends"] if b["name"] == "mimic"]
    [lora] = [c for c in mimic["checks"] if not c["ok"]]
    assert lora["check"] == "lora"
    assert lora["reasons"][0]["field"] == "lora.sharding"
    assert "reference" in plan_["would_accept"] and "mimic" not in plan_["would_accept"]


def test_explicit_triton_with_fully_sharded_lora_is_accepted_at_plan_time(capsys, mimic_first):
    # SPEC "Why it exists" #2 with the real triton record: honoured, never substituted.
    argv = ("--model", "qwen3.5-35b-a3b", "-tp", "2", "--enable-lora", "--fully-sharded-loras",
            "--device", "sm103", "--enforce-eager", "--moe-backend", "triton")  # fmt: skip
    code, plan_ = plan_json(capsys, *argv)
    assert code == 0 and plan_["selected"] == "triton" and plan_["how"] == "explicit"
    [gmm] = [b for b in plan_["backends"] if b["name"] == "grouped_mm"]
    assert not gmm["accepts"]  # grouped_mm still refuses fully sharded LoRA


def test_attention_only_lora_plans_without_a_lora_backend(capsys, mimic_first):
    argv = ("--model", "qwen3.5-35b-a3b", "-tp", "2", "--enable-lora", "--fully-sharded-loras",
            "--lora-target-modules", "q_proj,v_proj", "--device", "b200", "--enforce-eager")  # fmt: skip
    code, plan_ = plan_json(capsys, *argv)
    assert code == 0
    assert plan_["deployment"]["lora_on_experts"] is False
    assert plan_["deployment"]["lora_targets"] == ["q_proj", "v_proj"]
    assert plan_["selected"] == "mimic"  # not lora_only, ranked first


def test_cuda_graphs_default_on_for_cuda_targets_and_enforce_eager_turns_them_off(capsys):
    code, out, _ = plan(capsys, "--model", "tiny", "--device", "h200", "--moe-backend", "reference")
    assert code == 3 and "cuda_graphs = True" in out
    assert plan(capsys, "--model", "tiny", "--device", "h200", "--moe-backend", "reference",
                "--enforce-eager")[0] == 0  # fmt: skip
    _, plan_ = plan_json(capsys, "--model", "tiny", "--device", "cpu")
    assert plan_["deployment"]["cuda_graphs"] is False


def test_enable_expert_parallel_follows_vllm(capsys):
    # vLLM: experts split over the tp ranks (ep = tp) and the MoE layer's tp collapses to 1.
    _, plan_ = plan_json(capsys, "--model", "qwen3-30b-a3b", "-tp", "4",
                         "--enable-expert-parallel", "--device", "h200")  # fmt: skip
    dep = plan_["deployment"]
    assert (dep["tp"], dep["ep"], dep["local_experts"]) == (1, 4, 32)
    assert dep["intermediate_per_partition"] == 768


def test_expert_parallel_size_stacks_on_tp(capsys):
    _, plan_ = plan_json(capsys, "--model", "qwen3-30b-a3b", "-tp", "2", "-ep", "4",
                         "--device", "h200")  # fmt: skip
    assert (plan_["deployment"]["tp"], plan_["deployment"]["ep"]) == (2, 4)


def test_model_from_a_config_json_path(capsys, tmp_path):
    path = tmp_path / "nemotron" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(preset_dict("tiny-relu2")))
    code, plan_ = plan_json(capsys, "--model", str(path), "--device", "cpu")
    assert code == 0
    assert (plan_["deployment"]["name"], plan_["deployment"]["gated"]) == ("nemotron", False)


def test_local_device_by_default_works_without_a_gpu(capsys):
    code, plan_ = plan_json(capsys, "--model", "tiny")
    assert code == 0 and plan_["accepted"]


@pytest.mark.parametrize(
    "argv, named",
    [
        (("--model", "qwen3-30b-a3b", "-tp", "5"), "tensor_parallel_size"),  # 768 % 5
        (("--model", "qwen3-30b-a3b", "-ep", "3"), "expert_parallel_size"),  # 128 % 3
        (("--model", "no-such-model"), "model"),
        (("--model", "tiny", "--device", "tpu"), "device"),
        (("--model", "tiny", "--moe-backend", "cutlass"), "moe_backend"),
        (("--model", "tiny", "--dtype", "int4"), "dtype"),
        (("--model", "qwen3-30b-a3b", "-tp", "0"), "tensor_parallel_size"),
        (("--model", "qwen3-30b-a3b", "-ep", "-2"), "expert_parallel_size"),
        (("--model", "tiny", "--device", "cpu", "--cuda-graphs"), "cuda_graphs"),
        (("--model", "tiny", "--enable-lora", "--max-lora-rank", "0"), "--max-lora-rank"),
        (("--model", "tiny", "--enable-lora", "--max-loras", "0"), "--max-loras"),  # num_slots
    ],
)  # fmt: skip
def test_bad_configuration_exits_2_naming_the_key(capsys, argv, named):
    code, out, err = plan(capsys, *argv)
    assert code == 2 and out == ""
    assert f"'{named}'" in err


@pytest.mark.parametrize(
    "message, spoken",
    [
        ("config key 'num_slots' = 0", "config key '--max-loras' = 0"),  # the key
        ("raise max_rank or use a lower-rank adapter",
         "raise --max-lora-rank or use a lower-rank adapter"),  # a fix
        ("lora.max_rank = 32: at most 16", "lora.max_rank = 32: at most 16"),  # a reason's field
        ("max_ranks of num_slots_x", "max_ranks of num_slots_x"),  # longer words
    ],
)  # fmt: skip
def test_errors_name_the_flags_the_user_typed(message, spoken):
    assert in_flag_terms(message, VLLM_LORA_FLAGS) == spoken


@pytest.mark.parametrize(
    "argv",
    [
        (),  # --model is required
        ("--model", "tiny", "-tp", "two"),
        ("--model", "tiny", "--enable-expert-parallel", "-ep", "2"),  # exclusive
        ("--model", "tiny", "--cuda-graphs", "--enforce-eager"),  # exclusive
    ],
)
def test_bad_usage_exits_2(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", *argv])
    assert exit_.value.code == 2


# Issue 17.4: which exit code a deployment gets (docs/plan.md, "Exit codes").
# (argv, exit code, what stdout or stderr must say)
EXIT_CODES = [
    # well formed, no backend asked for runs it: an oracle refusal with the table
    pytest.param(("--model", "qwen3-30b-a3b", "-tp", "2", "-ep", "2", "--enable-lora",
                  "--fully-sharded-loras", "--device", "h200", "--enforce-eager",
                  "--moe-backend", "grouped_mm"), 3, "lora.sharding = fully_sharded",
                 id="fully-sharded-with-ep-on-grouped-mm-refused"),
    pytest.param(("--model", "tiny", "--enable-lora", "--max-lora-rank", "512", "--device",
                  "h200"), 3, "no registered backend accepts", id="auto-nothing-accepts"),
    # well formed and run: fully sharded over a TP group of 2, on each of 2 expert blocks
    pytest.param(("--model", "qwen3-30b-a3b", "-tp", "2", "-ep", "2", "--enable-lora",
                  "--fully-sharded-loras", "--device", "h200"), 0, "ACCEPTED: triton",
                 id="fully-sharded-with-ep-accepted-on-triton"),
    # a no-op as in vLLM: accepted, with a note in the table
    pytest.param(("--model", "tiny", "--enable-lora", "--fully-sharded-loras"), 0,
                 "note: --fully-sharded-loras at MoE tp 1 (tp 1) is a no-op",
                 id="fully-sharded-at-tp-1-noted"),
    pytest.param(("--model", "qwen3-30b-a3b", "-tp", "4", "--enable-expert-parallel",
                  "--enable-lora", "--fully-sharded-loras", "--device", "h200"), 0,
                 "(expert parallel leaves the MoE layer at tp 1) is a no-op",
                 id="fully-sharded-under-enable-expert-parallel-noted"),
    # arithmetic that cannot hold: a configuration error naming the key, value and fix
    pytest.param(("--model", "qwen3-30b-a3b", "-tp", "5"), 2,
                 "'tensor_parallel_size' = 5: expected a divisor of I = 768 (intermediate_size)."
                 " Fix: pick a divisor of 768", id="tp-not-dividing-I"),
    pytest.param(("--model", "qwen3-30b-a3b", "-ep", "3"), 2,
                 "'expert_parallel_size' = 3: expected a divisor of E = 128 (num_experts). "
                 "Fix: pick a divisor of 128", id="ep-not-dividing-E"),
]  # fmt: skip


@pytest.mark.parametrize("argv, code, says", EXIT_CODES)
def test_exit_code_says_what_happened(capsys, argv, code, says):
    got, out, err = plan(capsys, *argv)
    assert got == code and says in (out + err)
    if code == 3:  # the per-backend table and the fix, like every refusal
        assert "check " in out and out.splitlines()[-2].startswith("fix: ")
    if code == 2:
        assert out == ""
    _, doc = plan_json(capsys, *argv)
    assert doc["accepted"] is (code == 0)
    if code == 0 and "no-op" in says:
        assert doc["deployment"]["fully_sharded_loras"] is False  # what runs: unsharded
        assert any("no-op" in note for note in doc["notes"])


# DeepSeek-V3 routing (256 experts, top 8) with group settings a config can get wrong:
# (id, config changes, the field, the value, the fix)
GROUP_CASES = [
    # 256 groups of 1 expert: a group's score is the sum of its top-2 experts
    ("one-expert-per-group", {"n_group": 256, "topk_group": 4}, "n_group", "256",
     "Fix: set n_group to one of [1, 2, 4, 8, 16, 32, 64, 128]"),
    ("n-group-not-a-divisor", {"n_group": 3, "topk_group": 2}, "n_group", "3",
     "Fix: set n_group to one of [1, 2, 4, 8, 16, 32, 64, 128]"),
    # 128 groups of 2, 1 kept: 2 experts cannot hold top_k = 8
    ("groups-too-few-for-top-k", {"n_group": 128, "topk_group": 1}, "topk_group", "1",
     "Fix: set topk_group to at least 4"),
]  # fmt: skip


@pytest.mark.parametrize("case", GROUP_CASES, ids=[c[0] for c in GROUP_CASES])
def test_group_routing_errors_name_a_fix(case, capsys, tmp_path):
    _, changes, field, value, fix = case
    path = tmp_path / "deepseek" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(preset_dict("deepseek-v3") | changes))
    code, _, err = plan(capsys, "--model", str(path), "--device", "h200")
    assert code == 2, err
    assert f"config key '{field}' = {value}" in err and fix in err, err
