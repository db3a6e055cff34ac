"""`moelora run-batch` as a user meets it: a real child process on the tiny random model of
serve_fixtures. Good lines get their results (each text equal to the same request run alone)
and bad lines their own error records, in one file written line by line; the output path is
checked before the model loads; SIGTERM / SIGINT keep every line already written."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import serve_fixtures as sf

from moelora.cli import main
from moelora.serve import batch_file, protocol

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = "base"
ADAPTERS = ["fused-r8", "fused-r4-attn", "modules-r4", "fused-r2"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    # 256 positions: the signal test's 3-word prompts + 200 new tokens fit
    return sf.build(tmp_path_factory.mktemp("batch"), seed=model_seed,
                    max_positions=256)  # fmt: skip


def argv_of(served, source, out, *extra: str) -> list[str]:
    return ["run-batch", str(served.root / "model"), "-i", str(source), "-o", str(out),
            "--served-model-name", BASE, "--moe-backend", "reference", "--max-loras", "2",
            "--lora-modules", *[f"{n}={served.dirs[n]}" for n in ADAPTERS], *extra]  # fmt: skip


def line(custom_id, body: dict, url: str = "/v1/completions", **fields) -> bytes:
    record = {"custom_id": custom_id, "method": "POST", "url": url, "body": body} | fields
    return json.dumps(record).encode()


def completion(model: str, prompt, max_tokens: int, **sampling) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **sampling}  # fmt: skip


def words(count: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(1, 96)}" for _ in range(count))


def good_lines(rng: random.Random) -> dict[str, bytes]:
    """custom_id -> a line that runs (greedy): every route, the base model, each adapter."""
    chat = {"model": "fused-r8", "messages": [{"role": "user", "content": words(3, rng)}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    return {
        "plain": line("plain", completion("fused-r8", words(5, rng), 4)),
        "base": line("base", completion(BASE, words(2, rng), 3)),  # no adapter
        "attn": line("attn", completion("fused-r4-attn", words(4, rng), 5)),  # PEFT modules
        "chat": line("chat", chat, "/v1/chat/completions"),  # the chat template
        "ids": line("ids", completion("modules-r4", [5, 9, 17], 3)),  # prompt as token ids
        "rank": line("rank", completion("fused-r2", words(6, rng), 4)),  # a third adapter
    }


BAD = [
    # (id, the line, its record's custom_id, code, words in the message): which refusal
    ("no-custom-id", b'{"method": "POST", "url": "/v1/completions", "body": {}}', None, 400,
     ["custom_id missing", "non-empty string"]),
    ("custom-id-a-number", line(7, completion("fused-r8", "w1", 2)), None, 400,
     ["custom_id = 7", "non-empty string"]),
    ("custom-id-empty", line("", completion("fused-r8", "w1", 2)), None, 400, ["custom_id = ''"]),
    # the earlier "plain" (line 1) runs; this one is refused without taking its custom_id
    ("custom-id-again", line("plain", completion("fused-r8", "w1", 2)), None, 400,
     ["custom_id = 'plain' is already used by line 1"]),
    ("method-get", line("get", completion("fused-r8", "w1", 2), method="GET"), "get", 400,
     ["method = 'GET'", "'POST'"]),
    ("not-utf8", b'{"custom_id": "latin-\xe9", "method": "POST"}', None, 400, ["UTF-8"]),
    ("invalid-json", b'{"custom_id": "broken", ', None, 400, ["invalid JSON"]),
    ("not-an-object", b'["custom_id", 1]', None, 400, ["a JSON list", "expected an object"]),
    ("unknown-url", line("emb", {}, "/v1/embeddings"), "emb", 400, ["url = '/v1/embeddings'"]),
    ("unknown-model", line("nope", completion("nope", "w1", 2)), "nope", 404,
     ["'nope'", "fused-r8"]),
    ("bad-field", line("cold", completion("fused-r8", "w1", 2, temperature=-1)), "cold", 400,
     ["body: field 'temperature' = -1"]),
    # outside int64: torch.Generator cannot take it; the line is refused, the engine lives on
    ("seed-past-int64", line("seed", completion("fused-r8", "w1 w2", 3, temperature=1.0,
                                                seed=2**70)), "seed", 400, ["seed"]),
]  # fmt: skip


def run_batch(argv: list[str], log, timeout: float = 150.0) -> int:
    try:
        return sf.run_child(argv, log, timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"run-batch still running after {timeout} s:\n{log.read_text()[-3000:]}")


def records_of(path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def text_of(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def bar_count(log: str) -> int:
    """The progress bar's last count of finished lines."""
    return int(re.findall(r"\| *(\d+)/\d+ \[", log)[-1])


def test_each_line_gets_its_own_record(served, tmp_path, seed):
    good = good_lines(random.Random(seed))
    names = list(good)
    # bad lines between good ones, and a blank line (skipped, but counted in line numbers)
    lines = [good[n] for n in names[:3]] + [b[1] for b in BAD] + [b""]
    lines += [good[n] for n in names[3:]]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    log = tmp_path / "batch.log"
    code = run_batch(argv_of(served, tmp_path / "in.jsonl", out), log)
    assert code == 0, log.read_text()
    records = records_of(out)
    assert len(records) == len(good) + len(BAD)
    results = {r["custom_id"]: r for r in records if r["error"] is None}
    assert sorted(results) == sorted(good)
    errors = {int(re.match(r"line (\d+): ", r["error"]["message"])[1]): r
              for r in records if r["error"] is not None}  # fmt: skip
    for number, (case, _, custom_id, status, message_words) in enumerate(BAD, 4):
        record = errors[number]
        assert record["custom_id"] == custom_id and record["response"] is None, case
        assert record["error"]["code"] == status, (case, record["error"])
        assert all(w in record["error"]["message"] for w in message_words), (case, record)
    assert f"{len(good)} done, {len(BAD)} failed -> {out}" in log.read_text()
    assert bar_count(log.read_text()) == len(records)

    # the same lines, each alone in the engine (one row): the same greedy text
    (tmp_path / "alone.jsonl").write_bytes(b"\n".join(good.values()) + b"\n")
    code = run_batch(argv_of(served, tmp_path / "alone.jsonl", tmp_path / "alone.out",
                             "--max-num-seqs", "1"), tmp_path / "alone.log")  # fmt: skip
    assert code == 0, (tmp_path / "alone.log").read_text()
    alone = {r["custom_id"]: text_of(r) for r in records_of(tmp_path / "alone.out")}
    for name in good:
        assert text_of(results[name]) == alone[name], name


def test_a_missing_output_folder_exits_2_before_the_model_loads(served, tmp_path):
    (tmp_path / "in.jsonl").write_bytes(good_lines(random.Random(0))["plain"] + b"\n")
    out = tmp_path / "no-such-folder" / "out.jsonl"
    log = tmp_path / "batch.log"
    began = time.monotonic()
    code = run_batch(argv_of(served, tmp_path / "in.jsonl", out), log)
    took, text = time.monotonic() - began, log.read_text()
    assert code == 2 and "Traceback" not in text, text
    assert f"'--output-file' = '{out}'" in text and f"mkdir -p {out.parent}" in text, text
    # the oracle's line is the first thing start() prints, before any weight is read
    assert "moe backend" not in text and "Loading weights" not in text, text
    assert took < 15.0, took  # the interpreter and imports: about 2.5 s on 2 cores, idle


REFUSED_OUTPUTS = [
    # (id, the output path under tmp_path ("IN": the input file), words in the error)
    ("a-directory", ".", ["not a directory", "results.jsonl"]),
    ("under-a-file", "IN/out.jsonl", ["is a file"]),
    ("the-input-file", "IN", ["other than --input-file"]),
]


@pytest.mark.parametrize("case", REFUSED_OUTPUTS, ids=[c[0] for c in REFUSED_OUTPUTS])
def test_an_unusable_output_path_is_refused_naming_the_flag(case, served, tmp_path, capsys):
    _, where, message_words = case
    source = tmp_path / "in.jsonl"
    source.write_bytes(good_lines(random.Random(0))["plain"] + b"\n")
    out = tmp_path / where.replace("IN", "in.jsonl")
    assert main(argv_of(served, source, out)) == 2
    err = capsys.readouterr().err
    assert "'--output-file'" in err and all(w in err for w in message_words), err
    assert source.read_bytes() == good_lines(random.Random(0))["plain"] + b"\n"


def test_a_model_that_does_not_load_leaves_no_new_output_file(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(tmp_path), "-i", str(tmp_path / "in.jsonl"), "-o", str(out)]) == 2
    assert "config.json" in capsys.readouterr().err and not out.exists()


def test_a_fault_answering_one_line_is_its_error_record(monkeypatch):
    async def failing(ctx, body, chat):
        raise RuntimeError("the engine broke")

    monkeypatch.setattr(batch_file, "answer", failing)
    body = protocol.CompletionRequest.model_validate(completion("fused-r8", "w1", 2))
    out = asyncio.run(batch_file.answer_line(None, batch_file.BatchLine(3, "x", body, False)))
    assert out["custom_id"] == "x" and out["response"] is None
    assert out["error"] == {"code": 500, "message": "line 3: RuntimeError: the engine broke"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_keeps_every_line_written_and_exits_128_plus_it(sig, served, tmp_path):
    ids = [f"long-{i}" for i in range(40)]
    (tmp_path / "in.jsonl").write_bytes(
        b"\n".join(line(i, completion("fused-r8", "w1 w2 w3", 200)) for i in ids) + b"\n"
    )
    out = tmp_path / "out.jsonl"
    stale = json.dumps({"custom_id": "from-an-older-job", "response": None, "error": None})
    out.write_text(stale + "\n")
    log = tmp_path / "batch.log"
    argv = argv_of(served, tmp_path / "in.jsonl", out, "--max-num-seqs", "2")
    env = os.environ | {"PYTHONPATH": str(sf.TESTS.parent)}
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "moelora", *argv], stdout=sink,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not out.read_bytes() or b"from-an-older-job" in out.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(sig)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 128 + sig, text  # 143 for SIGTERM, 130 for SIGINT
    assert out.read_bytes().endswith(b"\n")  # no torn last line
    records = records_of(out)
    written = [r["custom_id"] for r in records]
    assert 1 <= len(records) < len(ids), text
    assert len(set(written)) == len(written) and set(written) <= set(ids), written
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in records)
    summary = (f"moelora run-batch: interrupted by {sig.name}: {len(records)} of {len(ids)} "
               f"lines written to {out}; the lines whose custom_id is missing there did not run")  # fmt: skip
    assert summary in text, text
    assert bar_count(text) == len(records), text  # finished lines only, no jump to the end
