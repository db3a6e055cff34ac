"""Is the config a LoRA class gets no slower than its tuned neighbours' (issue 19 item 5)?

For each bank (L adapters of rank R, token t on slot t % L) and T: the layer timed with the
row of every LoRA class the table holds at that T (each fitted to the GPU for this bank,
as a forward fits it), and which of them the lookup picks for the bank's class. A bank
whose class the table lacks takes its nearest tuned class (tiling/lora_class.py); the
verdict says whether that pick is within --slack of the fastest class's time. The
tune's timer: graph replay, L2 flushed, output checked against the reference first;
classes measured in alternating order over --reps rounds, best kept.

Usage (GPU): python -m benchmarks.class_neighbours --banks 8x64,32x16 --tokens 256,4096
"""

from __future__ import annotations

import argparse

from moelora.tiling.lora_class import LoRAClass
from moelora.tiling.pick import H200, pick_config

from .tune import Layer, fit_like_forward, load_model


def classes_at(dims: tuple, tokens: int) -> list[LoRAClass]:
    """The LoRA classes with a table row for this shape holding T."""
    return sorted(r.lora_class for r in H200.holding(dims, True, tokens))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--banks", default="8x64,32x16", help="LxR,... (adapters x rank)")
    p.add_argument("--tokens", default="256,4096")
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--slack", type=float, default=0.02, help="noise allowed in the verdict")
    args = p.parse_args()
    bad = 0
    for bank_name in args.banks.split(","):
        adapters, rank = (int(v) for v in bank_name.split("x"))
        model, dims, experts, lora = load_model(args.model, adapters, rank)
        mine = LoRAClass.of(lora.tile_rank, lora.num_slots)
        for t in (int(v) for v in args.tokens.split(",")):
            layer = Layer(model, experts, lora, t, args.iters)
            picked = H200.lookup(dims, True, t, mine).lora_class
            classes = classes_at(dims, t)
            best: dict[LoRAClass, float | None] = {}
            for rep in range(args.reps):
                for c in classes if rep % 2 == 0 else classes[::-1]:
                    cfg = pick_config(t, *dims, lora=True, rank=c.rank, slots=c.slots)
                    cfg = fit_like_forward(cfg, model, lora)
                    ms = layer.measure(cfg, True)
                    if ms is not None and (best.get(c) is None or ms < best[c]):
                        best[c] = ms
                    best.setdefault(c, ms)
            timed = {c: ms for c, ms in best.items() if ms is not None}
            fastest = min(timed, key=timed.get) if timed else None
            ok = fastest is not None and timed.get(picked, float("inf")) <= timed[fastest] * (
                1 + args.slack
            )
            bad += not ok
            cells = "  ".join(
                f"{c}{'*' if c == picked else ''} {'drop' if ms is None else f'{ms:.4f}'}"
                for c, ms in best.items()
            )
            verdict = "ok" if ok else f"SLOWER than {fastest}"
            print(f"bank {bank_name} (class {mine}) T={t}: {cells}  -> picked {picked}: {verdict}")
    print(f"{bad} case(s) where the picked class is slower than a neighbour's")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
