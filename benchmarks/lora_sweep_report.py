"""The LoRA sweep's table (`moelora bench --suite lora-sweep` beside the vLLM peer, one run of
scripts/gpu_lora_sweep.sh): per case moelora's LoRA-free and +LoRA ms, the floor and the
peer's +LoRA at the same (adapters, rank), then issue 19's targets, each a ratio of figures
from that one run. Pure functions over the JSON dicts; main() reads the files.

Inputs: the bench JSON (moelora/bench/runner.py's rows), the peer JSONs
(.peer/vllm_moe_lora_bench.py, one per (max-loras, rank)) and optionally
benchmarks/gemm_ceiling.py's JSON (the two base GEMMs on torch._grouped_mm).

Usage: python -m benchmarks.lora_sweep_report --bench out/sweep.json \
           --peers out/vllm_peer_L*_R*.json [--gemm out/gemm_ceiling.json] [--out out/sweep.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

from moelora.bench.cases import MIXED_RANKS, BenchCase
from moelora.bench.peer import PEER_DEFAULTS, peer_shape

# issue 19's targets, each a ratio measured in one run
PADDED_LIMIT = 1.15  # bank R = 128 of rank-8 adapters / bank R = 8 of the same
MIX_LIMIT = 1.2  # mixed bank's LoRA cost / the rank-weighted mix of the uniform banks
MANY_HIGH_FLOOR_LIMIT = 1.5  # 64 x 16 and 8 x 128 at T = 256, 4096, 16384: x floor
REFERENCE_FLOOR_LIMIT = 1.2  # 8 x 16 at T = 16 to 1024: x floor
LORA_OVER_BASE_LIMIT = 1.10  # +LoRA / LoRA-free at T >= 4096 (the floor's own ratio ~1.03)
GEMM_LORA_LIMIT, GEMM_BASE_LIMIT = 1.15, 1.0  # 8 x 16 at T >= 4096 / the two grouped GEMMs
LARGE_T = 4096
MIX_NAME = "mixed bank LoRA cost / rank-weighted mix"


def _same_run(peer: dict, want: dict) -> bool:
    """Whether a peer JSON ran the layer and LoRA config `want` (peer_shape's keys; what
    its JSON leaves unsaid is PEER_DEFAULTS)."""
    shape = {**PEER_DEFAULTS, **peer["shape"]}
    return all(shape.get(k) == v for k, v in want.items())


def case_rows(bench: dict, peers: list[dict]) -> tuple[list[dict], list[dict]]:
    """(one dict per bench row, the peer runs no row used). A peer figure is set beside a
    row only for the same layer and (adapters, rank) with every slot at the bank's rank
    (as the peer runs them); refused rows keep their reason."""
    used, out = set(), []
    for row in bench["rows"]:
        if "refused" in row:
            out.append(dict(case=row["case"], T=row["T"], refused=row["refused"]))
            continue
        base, lora = row["base"], row["lora"]
        vllm = vllm_ok = None
        if all(r == row["R"] for r in row["ranks"]):
            want = peer_shape(BenchCase(row["model"], row["T"], row["L"], row["R"]))
            for i, peer in enumerate(peers):
                peer_row = next((p for p in peer["rows"] if int(p["T"]) == row["T"]), None)
                if peer_row is not None and _same_run(peer, want):
                    used.add(i)
                    vllm, vllm_ok = peer_row.get("lora_pre_ms"), peer.get("check_ok")
        out.append(
            dict(
                case=row["case"], T=row["T"], L=row["L"], R=row["R"], ranks=row["ranks"],
                base_ms=base["ms"], lora_ms=lora["ms"], lora_over_base=lora["ms"] / base["ms"],
                floor_ms=lora["floor_ms"], lora_x_floor=lora["ms"] / lora["floor_ms"],
                floor_lora_over_base=lora["floor_ms"] / base["floor_ms"],
                ok=base["ok"] and lora["ok"], vllm_lora_ms=vllm, vllm_ok=vllm_ok,
            )
        )  # fmt: skip
    return out, [p for i, p in enumerate(peers) if i not in used]


def _find(rows: list[dict], tokens: int, adapters: int, rank: int, ranks) -> dict | None:
    """The timed row of that T and bank (ranks: each slot's real rank)."""
    for r in rows:
        want = (tokens, adapters, rank, list(ranks))
        if "refused" not in r and (r["T"], r["L"], r["R"], list(r["ranks"])) == want:
            return r
    return None


def _uniform(rows: list[dict], tokens: int, adapters: int, rank: int) -> dict | None:
    return _find(rows, tokens, adapters, rank, [rank] * adapters)


def _target(name: str, tokens: int, value: float | None, limit: float, note: str = "") -> dict:
    met = None if value is None else value <= limit
    return dict(target=name, T=tokens, value=value, limit=limit, met=met, note=note)


def targets(rows: list[dict], gemm: dict | None = None) -> list[dict]:
    """Issue 19's targets over case_rows' dicts, each {target, T, value, limit, met, note}:
    value and met None where a case of the ratio is missing (refused or not run); gemm:
    benchmarks/gemm_ceiling.py's JSON, or None."""
    tokens = sorted({r["T"] for r in rows})
    out = [g for t in tokens for g in (_padded(rows, t), _mixed(rows, t)) if g is not None]
    for adapters, rank in ((64, 16), (8, 128)):
        name = f"{adapters}x{rank} +LoRA x floor"
        out += [
            _x_floor(rows, name, t, adapters, rank, MANY_HIGH_FLOOR_LIMIT)
            for t in (256, 4096, 16384)
        ]
    out += [
        _x_floor(rows, "8x16 +LoRA x floor", t, 8, 16, REFERENCE_FLOOR_LIMIT)
        for t in (16, 64, 256, 1024)
    ]
    for r in rows:
        if "refused" not in r and r["T"] >= LARGE_T:
            note = f"{r['case'].split('/', 1)[1]}; the floor's own {r['floor_lora_over_base']:.3f}"
            out.append(
                _target(
                    "+LoRA / LoRA-free", r["T"], r["lora_over_base"], LORA_OVER_BASE_LIMIT, note
                )
            )
    return out + _gemm_targets(rows, gemm)


def _padded(rows: list[dict], tokens: int) -> dict | None:
    """Rank-8 adapters in an R = 128 bank against the same in an R = 8 bank (layer ms)."""
    padded, small = _find(rows, tokens, 8, 128, [8] * 8), _uniform(rows, tokens, 8, 8)
    if padded is None and small is None:
        return None
    value = padded["lora_ms"] / small["lora_ms"] if padded and small else None
    return _target("bank R=128 of rank-8 / bank R=8 (+LoRA ms)", tokens, value, PADDED_LIMIT)


def _mixed(rows: list[dict], tokens: int) -> dict | None:
    """The mixed bank's LoRA cost (+LoRA - LoRA-free) against the mean of the uniform banks'
    at its ranks: it holds two slots of each, each slot serving T / 8 tokens, so its work
    is that mean (the rank-weighted mix)."""
    mixed = _find(rows, tokens, 8, max(MIXED_RANKS), MIXED_RANKS)
    if mixed is None:
        return None
    alone = [_uniform(rows, tokens, 8, r) for r in sorted(set(MIXED_RANKS))]
    if not all(alone):
        return _target(MIX_NAME, tokens, None, MIX_LIMIT, "a uniform bank is missing")
    mix = mean(a["lora_ms"] - a["base_ms"] for a in alone)
    cost = mixed["lora_ms"] - mixed["base_ms"]
    return _target(
        MIX_NAME, tokens, cost / mix, MIX_LIMIT, f"mixed +{cost:.3f} ms, mix +{mix:.3f} ms"
    )


def _x_floor(
    rows: list[dict], name: str, tokens: int, adapters: int, rank: int, limit: float
) -> dict:
    r = _uniform(rows, tokens, adapters, rank)
    return _target(name, tokens, r["lora_x_floor"] if r else None, limit)


def _gemm_targets(rows: list[dict], gemm: dict | None) -> list[dict]:
    """8 x 16 at T >= 4096 against the two base GEMMs alone on torch._grouped_mm."""
    out = []
    for g in gemm["rows"] if gemm else []:
        r = _uniform(rows, int(g["T"]), 8, 16)
        if g["T"] < LARGE_T or r is None:
            continue
        both = g["grouped both"]["ms"]
        out.append(
            _target("8x16 +LoRA / grouped GEMMs", g["T"], r["lora_ms"] / both, GEMM_LORA_LIMIT)
        )
        out.append(
            _target("8x16 LoRA-free / grouped GEMMs", g["T"], r["base_ms"] / both, GEMM_BASE_LIMIT)
        )
    return out


def _ms(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(bench: dict, rows: list[dict], goals: list[dict], unused: list[dict]) -> str:
    """The stamp, the case table, the target table, and the peer runs no case matched."""
    c = bench.get("ceilings", {})
    lines = [
        f"LoRA sweep, {bench['device']}, torch {bench['torch']}, triton {bench['triton']}, "
        f"commit {bench['commit']}, {bench['time'][:10]}; floor from "
        f"{c.get('bandwidth_Bps', 0) / 1e12:.2f} TB/s, {c.get('matmul_flops', 0) / 1e12:.0f} "
        "TFLOP/s measured in the same run; vLLM: the peer's +LoRA with alignment hoisted out "
        "(lora_pre_ms), where it ran the same adapters and rank (! its own check against its "
        "fp32 reference failed). ms."
        + ("" if bench.get("complete", True) else " PARTIAL: the bench stopped before its end."),
        "",
        "| case | base ms | lora ms | lora/base | floor ms | lora x floor | vLLM lora ms | check |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        case = r["case"].split("/", 1)[1]
        if "refused" in r:
            lines.append(f"| {case} | refused: {r['refused'][:120]} | | | | | | |")
            continue
        lines.append(
            f"| {case} | {r['base_ms']:.3f} | {r['lora_ms']:.3f} | {r['lora_over_base']:.3f} | "
            f"{r['floor_ms']:.3f} | {r['lora_x_floor']:.2f} | {_ms(r['vllm_lora_ms'])}"
            f"{'!' if r['vllm_ok'] is False else ''} | "
            f"{'pass' if r['ok'] else 'FAIL'} |"
        )
    lines += ["", "| target | T | value | limit | met | note |", "|---|---:|---:|---:|---|---|"]
    for g in goals:
        met = {True: "yes", False: "**no**", None: "-"}[g["met"]]
        lines.append(
            f"| {g['target']} | {g['T']} | {_ms(g['value'])} | {g['limit']:.2f} | {met} | "
            f"{g['note']} |"
        )
    for p in unused:
        lines.append(f"\npeer run beside no case (another layer or T): {p['shape']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="moelora bench --suite lora-sweep --json")
    p.add_argument("--peers", nargs="*", default=[], help="the peer's JSONs of the same run")
    p.add_argument("--gemm", default=None, help="benchmarks/gemm_ceiling.py --json")
    p.add_argument("--out", default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    read = lambda path: json.loads(Path(path).read_text())  # noqa: E731
    bench = read(args.bench)
    rows, unused = case_rows(bench, [read(path) for path in args.peers])
    text = markdown(bench, rows, targets(rows, read(args.gemm) if args.gemm else None), unused)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
