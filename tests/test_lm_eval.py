"""EleutherAI's lm-evaluation-harness against `moelora serve` (issue 38, item 5): its
`local-completions` model with its defaults (tokenized_requests=True: prompts sent as
batches of token-id lists; the tokenizer read from the server's /tokenizer_info, /tokenize
and /detokenize), on two tiny local tasks defined here (a multiple-choice task scored by
loglikelihood: echo + logprobs + max_tokens 1; a generate_until task), through an adapter
and the base model. Every sample's loglikelihood, greedy flag and generated text, and every
score, equal the same task run by lm-eval's own `hf` model on the same directory (with the
adapter through PEFT: its `peft=` argument). One server."""

from __future__ import annotations

import json
import math
import random

import lm_eval
import pytest
import serve_fixtures as sf
import torch
from lm_eval.utils import check_remote_tokenizer_support

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = "base"
ADAPTER = "fused-r4-attn"  # experts and attention LoRA
LL_ATOL = 1e-4  # a sum of a few fp32 logprobs, each equal to ~1e-6
TASKS = ["tiny_mc", "tiny_gen"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    rng = random.Random(random.randrange(2**31))
    served = sf.build(tmp_path_factory.mktemp("lm_eval"), seed=rng.randrange(1000))
    # an end token (lm-eval's hf model needs the tokenizer's): id 0, also the model's, so
    # both sides stop at it
    served.base.generation_config.eos_token_id = 0
    served.base.generation_config.save_pretrained(served.root / "model")
    served.tokenizer.eos_token = "<pad>"
    served.tokenizer.save_pretrained(served.root / "model")
    write_tasks(served, rng)
    return served


def words(count: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(1, 96)}" for _ in range(count))


def greedy_word(served, model: str | None, context: str) -> str:
    """HF + PEFT's most likely next word after `context`: a choice lm-eval finds greedy."""
    module = served.truths.get(model, served.base)
    ids = torch.tensor([served.tokenizer(context)["input_ids"]])
    with torch.no_grad():
        token = module(input_ids=ids).logits[0, -1].argmax().item()
    return served.tokenizer.decode([token])


def write_tasks(served, rng: random.Random) -> None:
    """The two tasks' data and yaml under served.root / "tasks"."""
    folder = served.root / "tasks"
    folder.mkdir()
    docs = []
    for i in range(6):
        context = words(rng.randrange(2, 6), rng)
        # one choice is the greedy next word (adapter's on even docs, the base's on odd)
        greedy = greedy_word(served, ADAPTER if i % 2 == 0 else None, context)
        choices = [words(2, rng), greedy, words(1, rng)]
        rng.shuffle(choices)
        docs.append({"context": context, "choices": choices, "label": rng.randrange(3)})
    gens = [{"context": words(rng.randrange(2, 6), rng), "target": words(2, rng)}
            for _ in range(4)]  # fmt: skip
    for name, rows in (("mc", docs), ("gen", gens)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder}/"
              "{name}.jsonl\ntest_split: test\n")  # fmt: skip
    (folder / "mc.yaml").write_text(
        "task: tiny_mc\n" + common.format(name="mc") + "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "gen.yaml").write_text(
        "task: tiny_gen\n" + common.format(name="gen") + "output_type: generate_until\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
        'generation_kwargs:\n  until: ["w7"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )


@pytest.fixture(scope="module")
def server(served):
    argv = [str(served.root / "model"), "--served-model-name", BASE, "--moe-backend",
            "reference", "--max-num-seqs", "4", "--lora-modules",
            f"{ADAPTER}={served.dirs[ADAPTER]}"]  # fmt: skip
    server = sf.start(argv, served.root / "server.log")
    yield server
    assert server.stop() == 0, server.log.read_text()


def evaluate(served, model: str, model_args: dict) -> dict:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(served.root / "tasks"))
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                   task_manager=manager, log_samples=True)  # fmt: skip


CASES = [
    # (id, adapter or None, lm-eval batch size): batch > 1 sends several token-id lists at once
    ("adapter-batch-3", ADAPTER, 3),
    ("base-batch-1", None, 1),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_local_completions_scores_equal_hf_peft(served, server, case):
    _, adapter, batch = case
    out = evaluate(served, "local-completions", {
        "model": adapter or BASE, "base_url": server.url + "/v1/completions",
        "max_length": 128, "batch_size": batch, "num_concurrent": 2,
    })  # fmt: skip
    hf_args = {"pretrained": str(served.root / "model"), "dtype": "float32", "device": "cpu",
               "max_length": 128}  # fmt: skip
    if adapter is not None:
        hf_args["peft"] = str(served.dirs[adapter])
    ref = evaluate(served, "hf", hf_args)
    mc_out, mc_ref = out["samples"]["tiny_mc"], ref["samples"]["tiny_mc"]
    assert len(mc_out) == len(mc_ref) == 6
    greedy = 0
    for a, b in zip(mc_out, mc_ref):
        for (ll_out, greedy_out), (ll_ref, greedy_ref) in zip(
            (r[0] for r in a["resps"]), (r[0] for r in b["resps"])
        ):
            assert math.isfinite(ll_out) and abs(ll_out - ll_ref) < LL_ATOL, (ll_out, ll_ref)
            assert greedy_out == greedy_ref
            greedy += greedy_out
    assert greedy >= 3  # the greedy choices written for this model are found greedy
    gen_out, gen_ref = out["samples"]["tiny_gen"], ref["samples"]["tiny_gen"]
    assert [s["resps"] for s in gen_out] == [s["resps"] for s in gen_ref]
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_gen", "exact_match,none")):
        assert out["results"][task][metric] == ref["results"][task][metric], task


def test_lm_eval_finds_the_servers_tokenizer(server):
    """local-completions' default tokenizer backend ("auto") takes the server's tokenizer
    when /tokenizer_info and /tokenize answer as vLLM's do: no local copy is read."""
    assert check_remote_tokenizer_support(server.url + "/v1/completions")
