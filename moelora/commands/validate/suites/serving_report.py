"""The serving suite's measurements as the lines it prints (serving.py measures them)."""

from __future__ import annotations


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.3f} ms"


def print_summary(r: dict) -> None:
    """r: the record serving.measure_all returns."""
    m, s = r["model"], r["setup"]
    print(f"  {m['name']} E={m['E']} H={m['H']} I={m['I']} {m['moe_layers']} MoE layers "
          f"{m['dtype']}, R={s['rank']}, {s['slots']} slots ({s['hot']} pinned hot), "
          f"{s['cold']} cold via the host cache, T={s['tokens']}, backend {r['backend']}, "
          f"commit {r['commit']}")  # fmt: skip
    h2d = r["h2d"]
    gbs = "n/a" if h2d["gb_s"] is None else f"{h2d['gb_s']:.1f} GB/s"
    print(f"  adapter {r['adapter_bytes'] / 1e6:.1f} MB; H2D pinned copy {gbs} "
          f"({_ms(h2d['median_ms'])}); setup {r['setup_s']:.1f} s")  # fmt: skip
    for key, label in (("loads_alone", "loads alone"), ("loads_beside_forwards", "loads + fwds")):
        print(f"  {label:<14} {_loads(r[key], h2d['gb_s'])}")
    fa, fb = r["forwards_alone"], r["forwards_beside_loads"]
    print(f"  forwards alone  {fa['forwards']}: median {_ms(fa['median_ms'])}, wall "
          f"{fa['wall_s']:.3f} s")  # fmt: skip
    print(f"  forwards+loads  {fb['forwards']}: median {_ms(fb['median_ms'])} "
          f"(x{r['slowdown_median']:.3f}), wall {fb['wall_s']:.3f} s (x{r['slowdown_wall']:.3f})")  # fmt: skip


def _loads(s: dict, h2d_gb_s: float | None) -> str:
    """One line of load times; the slot write's rate against the H2D copy's when both are."""
    if not s["loads"]:
        return "none"
    eff = ""
    if s["write_gb_s"] and h2d_gb_s:
        eff = f" = {s['write_gb_s']:.1f} GB/s, {100 * s['write_gb_s'] / h2d_gb_s:.0f}% of H2D"
    return (f"n={s['loads']} from {s['origins']}: median load {_ms(s['median_load_ms'])}, "
            f"slot write {_ms(s['median_write_ms'])}{eff}")  # fmt: skip
