"""Tiling of the `triton` backend: the tile config type (config.py), the launch
arithmetic shared with the kernels (geometry.py), the H200 table as data (table.py,
h200_table.json) with its rows' LoRA classes (lora_class.py), the heuristic for shapes
without rows (heuristic.py), the pick (pick.py), the device fit (fit.py) and the plan of
one forward (plan.py). The backend (backends/triton.py) decides with these; the kernels
only read a plan."""
