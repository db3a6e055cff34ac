"""What scripts/parallel_bench.py concludes from its rows: whether `moelora plan` agrees with
what ran, where fully sharded LoRA pays against plain TP, the printed table and the summary.

Rows and layout records are the script's JSON dicts (its module docstring names the fields).
"""

from __future__ import annotations

from collections import defaultdict

# fully sharded "pays" when below this fraction of the time without it: a guessed margin for the
# noise between two medians of one run (not measured), so that a tie is not called a win
PAY_MARGIN = 0.98
NAN = float("nan")


def agreement(record: dict, rows: list[dict]) -> dict:
    """Whether `moelora plan`'s verdict agrees with what ran: accepted exactly when the layer
    was built, ran and every output equalled the single process, on the backend the plan
    selected."""
    verdict, passed = record["plan"], all(r.get("ok") for r in rows)
    if record.get("failed"):
        why = f"the layer was built but failed: {record['failed']}"
        why = f"plan accepted it; {why}" if verdict["accepted"] else why
    elif verdict["accepted"] and not record["ran"]:
        why = f"plan accepted it, the layer was refused: {record['error']}"
    elif not verdict["accepted"] and record["ran"]:
        why = "plan refused it, but the layer was built and ran"
    elif record["ran"] and verdict["selected"] != record["backend"]:
        why = f"plan selected {verdict['selected']}, the layer ran {record['backend']}"
    elif record["ran"] and not passed:
        bad = sum(not r.get("ok") for r in rows)
        why = f"plan accepted it, {bad} of {len(rows)} outputs differ from the single process"
    else:
        why = None
    ran_clean = record["ran"] and not record.get("failed") and passed
    return dict(checks_passed=ran_clean, plan_agrees=why is None, disagreement=why)


def fs_pays(rows: list[dict]) -> list[dict]:
    """Fully sharded against the same layout without it (same model, tp, ep, rank, mode, T)."""
    key = lambda r: (r["model"], r["tp"], r["ep"], r["rank"], r["add_inputs"], r["T"])  # noqa: E731
    plain = {key(r): r for r in rows if not r["fully_sharded"]}
    out = []
    for r in rows:
        if r["fully_sharded"] and key(r) in plain:
            plain_ms, fs_ms = plain[key(r)]["layer_ms"], r["layer_ms"]
            model, tp, ep, rank, mode, tokens = key(r)
            out.append(
                dict(model=model, tp=tp, ep=ep, rank=rank, add_inputs=mode, T=tokens,
                     plain_ms=plain_ms, fs_ms=fs_ms, fs_over_plain=fs_ms / plain_ms,
                     pays=fs_ms < PAY_MARGIN * plain_ms)
            )  # fmt: skip
    return out


def table(rows: list[dict], records: list[dict], pays: list[dict]) -> str:
    """One line per (layout, T); then the layouts that did not run or disagree with the plan;
    then fully sharded / not per (model, layout, rank, mode) across T."""
    head = (
        f"{'model':<15} {'layout':<26} {'T':>6} {'check':>5} {'rel_err':>8} {'layer':>9} "
        f"{'coll':>8} {'compute':>8} {'single':>8} {'speedup':>7} {'eager':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        flag = "*" if r["layer_host_bound"] else " "
        lines.append(
            f"{r['model']:<15} {r['layout']:<26} {r['T']:>6} {'pass' if r['ok'] else 'FAIL':>5} "
            f"{r.get('rel_err', NAN):>8.1e} {r['layer_ms']:>8.3f}{flag} "
            f"{r['collective_ms']:>8.3f} {r['compute_ms']:>8.3f} {r.get('single_ms', NAN):>8.3f} "
            f"{r.get('speedup', NAN):>6.2f}x {r.get('speedup_eager', NAN):>6.2f}x"
        )
    lines.append(
        "ms: the slowest rank's median (GPUs: behind the spin, * host bound: the spin ran "
        "out); speedup: single / layer; eager: the same for the eager times"
    )
    for rec in records:
        if rec.get("skipped") or not rec["ran"] or rec.get("failed") or not rec["plan_agrees"]:
            lines.append(_layout_line(rec))
    by_case = defaultdict(list)
    for p in pays:
        by_case[(p["model"], p["tp"], p["ep"], p["rank"], p["add_inputs"])].append(p)
    for (model, tp, ep, rank, mode), ps in by_case.items():
        cells = ", ".join(
            f"T={p['T']} {p['fs_over_plain']:.2f}{' pays' if p['pays'] else ''}" for p in ps
        )
        split = f"ep{ep}xtp{tp}" if ep > 1 else f"tp{tp}"
        lines.append(f"fully sharded / not, {model} {split} r{rank} {mode}: {cells}")
    return "\n".join(lines)


def _layout_line(rec: dict) -> str:
    if rec.get("skipped"):
        state = "skipped (time budget)"
    elif rec.get("failed"):
        state = f"FAILED ({rec['failed']})"
    else:
        state = "ran" if rec["ran"] else f"not built ({rec['error'].splitlines()[0]})"
    line = f"{rec['model']} {rec['layout']}: {state}; plan: {rec['plan']['verdict'][:160]}"
    return line + (f"; DISAGREES: {rec['disagreement']}" if rec["plan_agrees"] is False else "")


def summary(rows: list[dict], records: list[dict], elapsed_s: float) -> dict:
    ids = lambda pick: [r["model"] + "/" + r["layout"] for r in records if pick(r)]  # noqa: E731
    return dict(
        rows=len(rows),
        passed=sum(bool(r["ok"]) for r in rows),
        layouts=len(records),
        ran=sum(r["ran"] for r in records),
        skipped=ids(lambda r: r.get("skipped")),
        not_built=ids(lambda r: not r["ran"] and not r.get("skipped")),
        failed=ids(lambda r: r.get("failed")),
        plan_disagreements=ids(lambda r: r["plan_agrees"] is False),
        host_bound_rows=sum(r["layer_host_bound"] for r in rows),
        elapsed_s=elapsed_s,
    )


def verdict_line(s: dict) -> str:
    return (
        f"parallel_bench: {s['passed']}/{s['rows']} rows equal the single process; "
        f"{s['ran']}/{s['layouts']} layouts built, {len(s['failed'])} failed, "
        f"{len(s['skipped'])} skipped (time budget); plan disagrees on "
        f"{len(s['plan_disagreements'])}; {s['elapsed_s']:.0f} s"
    )
