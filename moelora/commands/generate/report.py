"""What `moelora generate` prints: a table with whole token rows and labelled numbers, or
(--json) one JSON document on stdout; and why a loaded adapter's rank differs from the `r`
its directory's adapter_config.json declares."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .check import CheckResult


def rank_note(path: Path, loaded_rank: int) -> str:
    """Why moelora's rank for the adapter (the largest over its factors) is not the `r` of
    its adapter_config.json: a rank_pattern entry, or PEFT's rewrite of per-module gate and
    up projections onto the fused gate_up_proj, the two ranks stacked (2 r). "" if equal."""
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return ""
    r = config.get("r")
    if r is None or r == loaded_rank:
        return ""
    pattern = config.get("rank_pattern") or {}
    keys = [k for k, v in pattern.items() if v == loaded_rank]
    if keys and "gate_up_proj" in keys[0] and loaded_rank == 2 * r:
        return (
            f"r = {r} in adapter_config.json; rank_pattern gives gate_up_proj {loaded_rank}: "
            "PEFT wrote per-module gate_proj and up_proj LoRA onto the fused gate_up_proj, "
            "stacking the two ranks"
        )
    if keys:
        return f"r = {r} in adapter_config.json; rank_pattern sets {keys[0]} to {loaded_rank}"
    return f"r = {r} in adapter_config.json; its largest factor has rank {loaded_rank}"


@dataclass(frozen=True)
class Run:
    """Everything one generate run reports."""

    what: str  # the model, in words
    header: str  # model type, MoE layers, shape, dtype, device
    dtype: str
    rows: list[str | None]  # adapter name per row (None: base)
    prompts: list[list[int]]
    new: list[list[int]]
    texts: list[tuple[str, str]] | None  # (prompt, new) decoded, with a tokenizer
    adapters: dict[str, str]  # name -> "rank N" (and the note when it differs from r)
    selection: str  # the oracle's selection line
    backend: str
    interpreted: bool
    seconds: float
    check: CheckResult | None  # None: --no-check


def text(run: Run, max_new_tokens: int) -> str:
    """The run as the table a reader scans: whole token rows, every number labelled."""
    lines = [f"\nmoelora generate: {run.what}, {run.header}"]
    lines += [f"  adapter {name}: {rank}" for name, rank in run.adapters.items()]
    lines.append(f"  {len(run.rows)} rows, {max_new_tokens} new tokens each, left-padded prompts")
    lines += [f"  {run.selection}", ""]
    check = run.check
    check_head = "against HF + PEFT generating the row alone" if check else "check"
    lines.append(f"  {'row':<4}{'adapter':<16}{'prompt':>6}  {check_head}")
    for row, name in enumerate(run.rows):
        cell = check.rows[row].cell() if check else "not checked"
        lines.append(f"  {row:<4}{name or 'base':<16}{len(run.prompts[row]):>6}  {cell}")
        lines.append(f"      new tokens: {run.new[row]}")
        if run.texts is not None:
            lines.append(f"      {run.texts[row][0]!r} -> {run.texts[row][1]!r}")
    lines += ["", f"  generate: {run.seconds:.2f} s for {len(run.rows)} rows"]
    if check is None:
        lines.append("  verdict: not checked (--no-check): no comparison ran")
        return "\n".join(lines)
    lines.append(
        f"  HF + PEFT ran with transformers' {check.implementation} experts implementation"
    )
    lines += [f"  {noise.describe()}" for noise in check.noise]
    lines.append(f"  verdict: {check.verdict.text}")
    return "\n".join(lines)


def as_json(run: Run) -> str:
    """The run as one JSON document (every token, every number labelled)."""
    rows = []
    for row, name in enumerate(run.rows):
        entry = {"row": row, "adapter": name, "prompt_tokens": run.prompts[row]}
        entry["new_tokens"] = run.new[row]
        if run.texts is not None:
            entry["prompt_text"], entry["new_text"] = run.texts[row]
        if run.check:
            c = run.check.rows[row]
            entry |= {"hf_peft_new_tokens": c.want, "first_different_step": c.first_difference}
            entry["logits_rel_err"] = c.logits_rel_err
        rows.append(entry)
    doc = {
        "model": run.what, "dtype": run.dtype, "backend": run.backend,
        "interpreted": run.interpreted, "selection": run.selection, "adapters": run.adapters,
        "seconds": run.seconds, "rows": rows,
        "check": None if run.check is None else {
            "hf_experts_implementation": run.check.implementation,
            "hf_noise": [
                {"between": n.between, "logits_rel_err": n.rel_err, "row": n.row}
                for n in run.check.noise
            ],
            "logits_rel_tol": run.check.verdict.tol, "tolerance_rule": run.check.verdict.rule,
        },
        "verdict": "NOT CHECKED" if run.check is None else run.check.verdict.text,
        "exit_code": exit_code(run),
    }  # fmt: skip
    return json.dumps(doc, indent=2, allow_nan=True)


def exit_code(run: Run) -> int:
    """0 when unchecked or every row passed, 1 when a row differed (moelora.errors)."""
    return 0 if run.check is None or run.check.verdict.ok else 1
