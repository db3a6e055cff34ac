"""The generated parts of the docs, from committed data, so they cannot drift:
- the top of BENCHMARKS.md: the current Qwen3-30B-A3B table on the H200 (from the bench
  JSON named CURRENT_RUN in its archive, the peer's figures in its rows) and its plot (PNG, matplotlib:
  the `bench` extra);
- in docs/kernels.md: which rows of the H200 table use each knob (from
  moelora/tiling/h200_table.json);
- in benchmarks/README.md: the index of the tools (from benchmarks/registry.py).

CURRENT_RUN is the last full Qwen3 bench beside the vLLM peer whose kernels and Qwen3 table
rows are still the committed ones; a new such run replaces it (and then this script is
re-run). tests/test_docs_generated.py fails when a block differs from what this writes.

Usage: python -m benchmarks.report          # rewrite the blocks (and the plot)
       python -m benchmarks.report --check  # exit 1 naming each stale block
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from benchmarks.archive import archive_of, load
from moelora.presets import PRESETS, resolve_model
from moelora.tiling.config import PATH_KNOBS
from moelora.tiling.lora_class import REFERENCE, LoRAClass
from moelora.tiling.pick import H200
from moelora.tiling.table import INF, Table
from moelora.tiling.table_file import lows

ROOT = Path(__file__).resolve().parent.parent
CURRENT_RUN = "h200_7bbb67d_bench.json"  # the bench JSON the present table is made from
CURRENT = archive_of(CURRENT_RUN).name  # the archive holding it (benchmarks/archive.py)
PLOT = "docs/bench_qwen3_h200.png"
QWEN3 = (128, 8, 2048, 768)


def _block(name: str, source: str, body: str) -> str:
    head = f"<!-- generated:{name} begin (benchmarks/report.py from {source}; edit the script) -->"
    return f"{head}\n{body.rstrip()}\n<!-- generated:{name} end -->"


def replace_block(text: str, name: str, block: str) -> str:
    """text with its generated:<name> block replaced by `block` (which must exist)."""
    pattern = re.compile(rf"<!-- generated:{name} begin.*?<!-- generated:{name} end -->", re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"report: no generated:{name} block to replace")
    return pattern.sub(lambda _: block, text, count=1)


def current_block(run: str = CURRENT_RUN, table: Table = H200) -> str:
    """The top of BENCHMARKS.md from the archived bench JSON named `run`."""
    data = load(run)
    c = data["ceilings"]
    runs = sorted({r.run for r in table.rows if r.shape == QWEN3})
    lines = [
        f"## Now: the Qwen3-30B-A3B layer on the {data['device']} (commit {data['commit']})",
        "",
        "One MoE layer (E=128, K=8, H=2048, I=768), bf16, 8 adapters of rank 16 (token t on "
        "slot t % 8), from the top-k ids to y; CUDA-graph replay, L2 flushed, the median "
        "replay; every output checked against the reference before it was timed. "
        f"torch {data['torch']}, triton {data['triton']}, {data['time'][:10]}. The floor is "
        "max(bytes / copy bandwidth, FLOPs / matmul rate) for the actual routing, both "
        f"measured in the same run ({c['bandwidth_Bps'] / 1e12:.2f} TB/s, "
        f"{c['matmul_flops'] / 1e12:.0f} TFLOP/s); the peer is vLLM's fused MoE LoRA kernels "
        "on the same layer in the same run (config lookup and alignment hoisted out of its "
        "timing). ms.",
        "",
        "| T | moelora LoRA-free | x floor | moelora +LoRA | x floor | vLLM LoRA-free / +LoRA "
        "| +LoRA vs vLLM |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in sorted(data["rows"], key=lambda r: r["T"]):
        b, lo, p = row["base"], row["lora"], row.get("peer") or {}
        vb, vl = p.get("base_pre_ms"), p.get("lora_pre_ms")
        peer = f"{vb:.3f} / {vl:.3f}" if vb and vl else "-"
        speed = f"{vl / lo['ms']:.2f}x faster" if vl else "-"
        lines.append(
            f"| {row['T']} | {b['ms']:.3f} | {b['ratio']:.2f} | {lo['ms']:.3f} | "
            f"{lo['ratio']:.2f} | {peer} | {speed} |"
        )
    lines += [
        "",
        f"![time against T: moelora, the vLLM peer and the floor]({PLOT})",
        "",
        f"Raw: benchmarks/results/{archive_of(run).name} ({run}). The Qwen3 rows of the tile table in effect "
        f"come from the runs {', '.join(runs)}. How the layer runs: docs/kernels.md; how "
        "each choice was measured: docs/history/kernel_log.md; other models and every "
        "earlier run: docs/history/benchmarks.md.",
    ]
    return _block(
        "current", f"{run} in benchmarks/results/{archive_of(run).name}", "\n".join(lines)
    )


def plot(run: str = CURRENT_RUN, out: Path = ROOT / PLOT) -> None:
    """Time against T (log-log): moelora and the peer, LoRA-free and +LoRA, and the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(load(run)["rows"], key=lambda r: r["T"])
    t = [r["T"] for r in rows]
    peer = [r.get("peer") or {} for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    series = [
        ("moelora +LoRA", [r["lora"]["ms"] for r in rows], "C0", "-"),
        ("moelora LoRA-free", [r["base"]["ms"] for r in rows], "C0", ":"),
        ("vLLM +LoRA", [p.get("lora_pre_ms") for p in peer], "C1", "-"),
        ("vLLM LoRA-free", [p.get("base_pre_ms") for p in peer], "C1", ":"),
        ("floor +LoRA", [r["lora"]["floor_ms"] for r in rows], "0.4", "--"),
    ]
    for label, ys, color, style in series:
        pts = [(x, y) for x, y in zip(t, ys) if y]
        ax.plot(*zip(*pts), style, color=color, marker="o", markersize=3, label=label)
    ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="ms per layer (graph replay)")
    ax.set_title("Qwen3-30B-A3B MoE layer, bf16, 8 adapters of rank 16, H200")
    ax.set_xticks(t, [str(v) for v in t])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, metadata={"Software": None})
    plt.close(fig)


def _label(shape: tuple) -> str:
    for name in PRESETS:
        s = resolve_model(name).shape
        if (s.num_experts, s.top_k, s.hidden_size, s.intermediate_size) == shape:
            return name
    return "E={} K={} H={} I={}".format(*shape)


def _class_label(lora_class: LoRAClass) -> str:
    """'' for the REFERENCE class, else ' 8x128' (slots x rank)."""
    return "" if lora_class == REFERENCE else f" {lora_class}"


def _ranges(rows: list) -> str:
    """'1..8, 1025..2048' from rows of one shape and mode (sorted by bound), merged."""
    spans: list[list[int]] = []
    for low, high in rows:
        if spans and spans[-1][1] + 1 == low:
            spans[-1][1] = high
        else:
            spans.append([low, high])
    return ", ".join(f"{a}.." if b == INF else f"{a}..{b}" for a, b in spans)


def knob_block(table: Table = H200) -> str:
    """Which rows of `table` use each code-path knob (docs/kernels.md)."""
    low = lows(table.rows)
    lines = [
        f"Of the {len(table.rows)} rows of moelora/tiling/h200_table.json, the rows that set "
        "each knob (T ranges per model and mode; a knob a row does not set is off):",
        "",
        "| knob | rows | where |",
        "|---|---:|---|",
    ]
    for knob in PATH_KNOBS:
        values = sorted({r.knobs[knob] for r in table.rows if r.knobs.get(knob)})
        for value in values or [True]:
            using = [r for r in table.rows if r.knobs.get(knob) == value]
            where: dict = {}
            for r in sorted(using, key=lambda r: r.order):
                mode = "LoRA-free" if not r.lora else "+LoRA" + _class_label(r.lora_class)
                where.setdefault((_label(r.shape), mode), []).append((low[r.key], r.max_tokens))
            text = "; ".join(
                f"{name} {mode} T {_ranges(spans)}" for (name, mode), spans in where.items()
            )
            name = knob if value is True else f"{knob} = {value}"
            lines.append(f"| `{name}` | {len(using)} | {text or 'none'} |")
    return _block("knobs", "moelora/tiling/h200_table.json", "\n".join(lines))


def index_block() -> str:
    """benchmarks/README.md's index: the registered tools (benchmarks/registry.py)."""
    from benchmarks.registry import TOOLS

    lines = ["| tool | kind | needs | what |", "|---|---|---|---|"]
    for tool in TOOLS.values():
        lines.append(f"| `{tool.name}` | {tool.kind.value} | {tool.needs.value} | {tool.summary} |")
    return _block("index", "benchmarks/registry.py", "\n".join(lines))


DOCS = {  # file -> (block name, generator)
    "BENCHMARKS.md": ("current", current_block),
    "docs/kernels.md": ("knobs", knob_block),
    "benchmarks/README.md": ("index", index_block),
}


def stale() -> list[str]:
    """The docs whose generated block differs from what the generators write now."""
    out = []
    for file, (name, make) in DOCS.items():
        text = (ROOT / file).read_text()
        if replace_block(text, name, make()) != text:
            out.append(f"{file} (generated:{name})")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    args = p.parse_args()
    if args.check:
        bad = stale()
        for item in bad:
            print(f"report: stale: {item}; run python -m benchmarks.report")
        return 1 if bad else 0
    for file, (name, make) in DOCS.items():
        path = ROOT / file
        path.write_text(replace_block(path.read_text(), name, make()))
        print(f"report: wrote {file} (generated:{name})")
    try:
        plot()
        print(f"report: wrote {PLOT}")
    except ImportError:
        print("report: no matplotlib (pip install moelora[bench]): plot not redrawn", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
