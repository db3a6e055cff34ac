"""GPU check and timing of the Gated DeltaNet decode step (Qwen3.5's linear attention) in
kernels/gated_delta.py against the same step in torch ops (moelora/engine/linear_attention.py
with fused=False), at Qwen3.5-35B-A3B's layer shapes (16 key heads, 32 value heads, widths
128, conv width 4), bf16, rows 1 / 16 / 64: core and states within bf16's tolerance, then
each form's time per step (one CUDA graph replayed, as the decode step runs it; CUDA events,
warmed up at the shape, the two forms alternated), and the bytes one step must move (the rows' fp32 states read and written) over the time: a
fraction of copy bandwidth. PASS / FAIL lines and a JSON record.

    python scripts/gpu_gated_delta.py --out /tmp/gd          # on the H200
    TRITON_INTERPRET=1 python scripts/gpu_gated_delta.py --device cpu --dtype fp32 --rows 1,2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

SHAPE = dict(hk=16, hv=32, dk=128, dv=128, width=4)  # Qwen3.5-35B-A3B's linear_attn


def _mixer(dtype, device, g):
    hk, hv, dk, dv, width = (SHAPE[k] for k in ("hk", "hv", "dk", "dv", "width"))
    channels = 2 * hk * dk + hv * dv
    weight = (torch.randn(channels, 1, width, generator=g) * 0.5).to(device, dtype)
    conv = SimpleNamespace(weight=weight, bias=None)
    norm = SimpleNamespace(weight=(1 + 0.3 * torch.randn(dv, generator=g)).to(device, dtype),
                           variance_epsilon=1e-6)  # fmt: skip
    return SimpleNamespace(
        conv1d=conv, activation="silu", num_k_heads=hk, num_v_heads=hv, head_k_dim=dk,
        head_v_dim=dv, key_dim=hk * dk, value_dim=hv * dv, conv_dim=channels,
        conv_kernel_size=width, A_log=torch.randn(hv, generator=g).to(device, dtype),
        dt_bias=torch.randn(hv, generator=g).to(device, dtype), norm=norm,
    )  # fmt: skip


def main(argv=None) -> int:
    from moelora.compare import REL_TOL, compare
    from moelora.engine import linear_attention as la

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device, g = torch.device(args.device), torch.Generator().manual_seed(0)
    mixer = _mixer(dtype, device, g)
    result, ok = {"shape": SHAPE, "dtype": args.dtype, "rows": {}}, True
    for rows in (int(r) for r in args.rows.split(",")):
        spare = rows + 1
        state = la.LinearState(
            torch.randn(spare, mixer.conv_dim, SHAPE["width"] - 1, generator=g).to(device, dtype),
            (torch.randn(spare, SHAPE["hv"], SHAPE["dk"], SHAPE["dv"], generator=g) * 0.3).to(device),
        )  # fmt: skip
        at = torch.randperm(spare, generator=g)[:rows].to(device)
        qkv = torch.randn(rows, mixer.conv_dim, generator=g).to(device, dtype)
        z = torch.randn(rows, mixer.value_dim, generator=g).to(device, dtype)
        b, a = (torch.randn(rows, SHAPE["hv"], generator=g).to(device, dtype) for _ in "ba")
        forms = {}
        for fused in (True, False):
            copy = la.LinearState(state.conv.clone(), state.recurrent.clone())
            out = la.decode(mixer, copy, at, qkv, z, b, a, fused=fused)
            forms[fused] = (out.float().cpu(), copy.recurrent.cpu())
        tol = REL_TOL[dtype]
        err_out = compare(forms[True][0], forms[False][0], tol=float("inf")).rel_err
        err_state = compare(forms[True][1], forms[False][1], tol=float("inf")).rel_err
        passed = err_out <= tol and err_state <= tol
        ok &= passed
        timing = {}
        if device.type == "cuda":
            # timed as the decode step runs it: one CUDA graph replayed (no host launch cost)
            work = la.LinearState(state.conv.clone(), state.recurrent.clone())
            graphs = {}
            for fused in (True, False):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        la.decode(mixer, work, at, qkv, z, b, a, fused=fused)
                torch.cuda.current_stream().wait_stream(side)
                graphs[fused] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[fused]):
                    la.decode(mixer, work, at, qkv, z, b, a, fused=fused)
            for fused in (True, False, True, False):  # warm both, then alternate
                for _ in range(10):
                    graphs[fused].replay()
            for fused in (True, False, True, False):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                for _ in range(args.iters):
                    graphs[fused].replay()
                end.record()
                torch.cuda.synchronize()
                key = "fused_us" if fused else "torch_us"
                timing[key] = min(timing.get(key, 1e9), start.elapsed_time(end) * 1e3 / args.iters)
            moved = rows * SHAPE["hv"] * SHAPE["dk"] * SHAPE["dv"] * 4 * 2  # states read + written
            timing["state_bytes"] = moved
            timing["fused_GBps"] = moved / timing["fused_us"] / 1e3
        record = {"pass": passed, "rel_err_out": err_out, "rel_err_state": err_state, "tol": tol,
                  **timing}  # fmt: skip
        result["rows"][rows] = record
        print(f"{'PASS' if passed else 'FAIL'} gated_delta rows {rows}: {record}", flush=True)
    result["ok"] = ok
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_gated_delta.json").write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
