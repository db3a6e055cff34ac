"""`moelora plan`'s readable table, from the plan as data (moelora.commands.plan.resolve)."""

from __future__ import annotations

from typing import Any

from ...backends.checks import CHECKS

# validation level -> the table's cell
VALIDATED_CELL = {
    "validated": "yes",
    "same_architecture": "same cc",
    "other_dtype": "other dtype",
    "not_validated": "no",
}


def render(plan: dict[str, Any]) -> str:
    """Device facts with their sources, one row per check and one column per backend
    (reasons as numbered notes), the validation row, notes, where the selected backend was
    validated (or, on a refusal, the fix), and the verdict last."""
    names = [b["name"] for b in plan["backends"]]
    notes: list[str] = []
    rows = [["check", *names]]
    for index, (check, _) in enumerate(CHECKS):
        row = [check]
        for backend in plan["backends"]:
            cell = backend["checks"][index]
            if cell["ok"]:
                row.append("ok")
                continue
            notes.append(
                f"[{len(notes) + 1}] {backend['name']} {check}: "
                + "; ".join(_reason_text(r) for r in cell["reasons"])
            )
            row.append(f"FAIL [{len(notes)}]")
        rows.append(row)
    rows.append(["verdict", *(_column_verdict(plan, b) for b in plan["backends"])])
    rows.append(["validated here", *(_validated_cell(plan, b) for b in plan["backends"])])
    lines = [f"deployment: {_describe(plan['deployment'])}", "", *_device(plan), ""]
    lines += _table(rows)
    lines += ["", *notes] if notes else []
    lines += ["", *(f"note: {n}" for n in plan["notes"])] if plan["notes"] else []
    # The verdict stays the last line (scripts read it with tail -1).
    lines.append("")
    lines.append(_validated_line(plan) if plan["accepted"] else f"fix: {plan['fix']}")
    lines.append(f"verdict: {plan['verdict']}")
    return "\n".join(lines)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _device(plan: dict[str, Any]) -> list[str]:
    if plan["device_source"] == "probed":
        head = "device facts (--device local: probed on this machine)"
    else:
        head = f"device facts (--device {plan['device_arg']}: a named target, not this machine)"
    rows = [[f["fact"], f["value"], f["source"]] for f in plan["device_facts"]]
    return [head, *("  " + line for line in _table(rows))]


def _validated_line(plan: dict[str, Any]) -> str:
    [chosen] = [b for b in plan["backends"] if b["name"] == plan["selected"]]
    validation = chosen["validation"]
    if validation["level"] != "validated":
        return (
            f"validated: not here. {chosen['name']} has run on {validation['validated_on']} "
            f"(not on {plan['deployment']['device']} in {plan['deployment']['dtype']}: warning "
            "on stderr)"
        )
    run = validation["runs"][0]
    return f"validated: {chosen['name']} on {run['device']}: {run['result']} ({run['date']}; {run['source']})"


def _reason_text(reason: dict[str, Any]) -> str:
    return f"{reason['field']} = {reason['value']}: needs {reason['needed']}"


def _validated_cell(plan: dict[str, Any], backend: dict[str, Any]) -> str:
    """Whether the backend's validation covers this target; "-" under a backend that
    refuses the deployment (validated or not, it does not run here)."""
    if _column_verdict(plan, backend) == "refuses":
        return "-"
    return VALIDATED_CELL[backend["validation"]["level"]]


def _column_verdict(plan: dict[str, Any], backend: dict[str, Any]) -> str:
    if backend["name"] == plan["selected"]:
        return "SELECTED"
    return "accepts" if backend["accepts"] else "refuses"


def _describe(dep: dict[str, Any]) -> str:
    keys = (
        "name",
        "num_experts",
        "top_k",
        "hidden_size",
        "intermediate_per_partition",
        "activation",
        "routing",
        "dtype",
        "quantization",
        "tp",
        "ep",
        "lora_on_experts",
        "device",
        "cuda_graphs",
        "requested_backend",
    )
    return " ".join(f"{k}={dep[k]}" for k in keys)
