"""Benchmarks: case registry from presets, GPU ceilings, floors and a runner (JSON out)."""
