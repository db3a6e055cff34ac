"""benchmarks/archive.py: a run's raw files go into one archive per device and run kind and
come back unchanged by name; every raw file the docs cite is in the committed archives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import archive

ROOT = Path(__file__).resolve().parent.parent

# (raw file name, the archive it belongs in)
KINDS = [
    ("h200_4acd27b_validate.log", "h200_validate.txt"),
    ("h200_7bbb67d_bench.json", "h200_bench.jsonl"),
    ("h200_ab_v6_28cc3e4_bench.json", "h200_bench.jsonl"),  # an A/B tree's bench rows
    ("h200_6c035e2_ab_stream_8x128.log", "h200_ab.txt"),
    ("h200_310c49a_vllm_peer_L8_R64.json", "h200_peer.jsonl"),  # peer before bench
    ("h200_6c035e2_t256_tune_8x256.log", "h200_tune.txt"),
    ("h200_310c49a_sweep.md", "h200_sweep.txt"),
    ("h200_310c49a_gpu.txt", "h200_device.txt"),
    ("h200x2_318b030_parallel.log", "h200x2_parallel.txt"),
]


@pytest.mark.parametrize("name,want", KINDS, ids=[k[0] for k in KINDS])
def test_the_kind_comes_from_the_name(name: str, want: str) -> None:
    assert archive.archive_of(name).name == want


def test_added_files_come_back_unchanged(tmp_path, monkeypatch, seed) -> None:
    monkeypatch.setattr(archive, "RESULTS", tmp_path)
    rows = {"T": seed, "ms": [seed / 7, 1.5]}
    (tmp_path / "h200_abc1234_bench.json").write_text(json.dumps(rows))
    logs = {
        "h200_abc1234_validate.log": f"validate: {seed}/{seed} passed\n",
        "h200_def5678_validate.log": "no final newline",  # stored with one
    }
    for name, text in logs.items():
        (tmp_path / name).write_text(text)
    for name in ["h200_abc1234_bench.json", *logs]:
        archive.add(tmp_path / name)
        assert not (tmp_path / name).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h200_bench.jsonl", "h200_validate.txt"]
    assert archive.load("h200_abc1234_bench.json") == rows
    assert archive.load("h200_abc1234_validate.log") == logs["h200_abc1234_validate.log"]
    assert archive.load("h200_def5678_validate.log") == "no final newline\n"
    with pytest.raises(KeyError):
        archive.load("h200_0000000_validate.log")


def test_every_raw_file_the_docs_cite_is_archived() -> None:
    pattern = r"h200(?:x\d)?_(?:ab_v\d+_)?[0-9a-f]{7}_[\w.-]*?\.(?:json|log|txt|md)\b"
    docs = ["BENCHMARKS.md", "docs/history/benchmarks.md", "docs/history/kernel_log.md"]
    names = {n for doc in docs for n in re.findall(pattern, (ROOT / doc).read_text())}
    assert len(names) > 20
    for name in sorted(names):
        assert archive.load(name), name
