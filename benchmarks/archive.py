"""Archive GPU runs' raw files into benchmarks/results/: one file per device and run kind.

A run writes files named <device>_<commit>_<what>.<ext> (JSON, logs, tables); `python -m
benchmarks archive FILE ...` appends each to its archive and removes it: JSON files become
one line of <device>_<kind>.jsonl ({"file": name, "data": ...}), text files a section of
<device>_<kind>.txt headed "==> name <==" (as `head` prints several files). The kind is
read from the name (KINDS, first match). `load(name)` gives a raw file back by its name,
so docs keep citing the names the runs wrote.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NAME = re.compile(r"^(?P<device>[a-z0-9]+)_(?:ab_v\d+_)?[0-9a-f]{7}_?(?P<what>.*)$")
# (kind, pattern on <what>): the first that matches names the archive
KINDS = (
    ("peer", r"peer|vllm"),
    ("parallel", r"parallel"),
    ("hf", r"^hf|generate|_hf"),
    ("sweep", r"sweep"),
    ("tune", r"tune|neighbours|class"),
    ("validate", r"validate|check|ranks|serving"),
    ("profile", r"profile|lora_cost"),
    ("ceiling", r"ceiling|floor"),
    ("ab", r"^ab|_ab|knob|decode|align|trees|stream"),
    ("device", r"gpu"),
    ("bench", r"."),
)
SECTION = "==> {} <==\n"


def archive_of(name: str) -> Path:
    """The archive a raw file named `name` goes to."""
    match = NAME.match(name)
    if not match:
        raise SystemExit(f"archive: {name}: not <device>_<commit>_<what>.<ext>")
    what = match["what"].rsplit(".", 1)[0]
    kind = next(k for k, pattern in KINDS if re.search(pattern, what))
    ext = "jsonl" if name.endswith(".json") else "txt"
    return RESULTS / f"{match['device']}_{kind}.{ext}"


def add(path: Path) -> Path:
    """Append one raw file to its archive (and remove it); returns the archive."""
    target = archive_of(path.name)
    with target.open("a") as out:
        if target.suffix == ".jsonl":
            data = json.loads(path.read_text())
            out.write(json.dumps({"file": path.name, "data": data}, separators=(",", ":")) + "\n")
        else:
            text = path.read_text()
            out.write(SECTION.format(path.name) + text + ("" if text.endswith("\n") else "\n"))
    path.unlink()
    return target


def load(name: str):
    """The raw file `name` from its archive: the parsed JSON, or the text."""
    target = archive_of(name)
    if target.suffix == ".jsonl":
        for line in target.read_text().splitlines():
            record = json.loads(line)
            if record["file"] == name:
                return record["data"]
    else:
        head = SECTION.format(name)
        text = target.read_text()
        if head in text:
            body = text.split(head, 1)[1]
            return re.split(r"^==> .+ <==$\n", body, maxsplit=1, flags=re.M)[0]
    raise KeyError(f"{name} is not in {target.name}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "files", nargs="+", type=Path, help="raw files a run wrote (removed once archived)"
    )
    args = p.parse_args()
    for path in args.files:
        print(f"archive: {path.name} -> {add(path).relative_to(RESULTS.parent.parent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
