"""GPU-free capability tables: (deployment, backend, expected verdict, expected reason field)
for every registered backend. Each row's comment says which edge it covers."""

from __future__ import annotations

import dataclasses

import pytest
from oracle_doubles import deploy, fields

from moelora.backends.base import check
from moelora.backends.registry import REGISTRY
from moelora.config import AddInputs, DeviceFacts
from moelora.device import target

ACCEPT, REFUSE = "accept", "refuse"


def on(device: DeviceFacts, **knobs):
    """deploy(...) on a hand-made device (one not in device.TARGETS)."""
    return dataclasses.replace(deploy(**knobs), device=device)


def resized(dep, **shape_fields):
    """dep with MoEShape fields replaced (sizes no preset has)."""
    return dataclasses.replace(dep, shape=dataclasses.replace(dep.shape, **shape_fields))


SM75 = DeviceFacts("cuda", "sm75", (7, 5), target("h200").packages)
CPU_NOT_INTERPRETED = dataclasses.replace(target("cpu"), interpreted=False)
H200_WITHOUT_TRITON = dataclasses.replace(target("h200"), packages=frozenset({"torch"}))

# (id, deployment factory, backend, verdict, reason field or None)
TABLE = [
    # reference: everything, any device; only CUDA-graph capture is refused (host syncs).
    ("ref-qwen3-tp4-fully-sharded", lambda: deploy("qwen3-30b-a3b", tp=4, lora=True, fully_sharded=True), "reference", ACCEPT, None),
    ("ref-relu2-cpu", lambda: deploy("nemotron-h", "cpu", lora=True), "reference", ACCEPT, None),
    ("ref-gpt-oss-bias-swigluoai", lambda: deploy("gpt-oss-20b", "b200", lora=True), "reference", ACCEPT, None),
    ("ref-deepseek-v3-ep8-rank256-64-slots", lambda: deploy("deepseek-v3", "sm100", ep=8, lora=True, rank=256, loras=64), "reference", ACCEPT, None),
    ("ref-llama4-fp16", lambda: deploy("llama4-scout", "sm90", dtype="float16"), "reference", ACCEPT, None),
    ("ref-mixtral-tp2-ep4-overwrite", lambda: deploy("mixtral-8x7b", "h100", tp=2, ep=4, lora=True, add_inputs=AddInputs.OVERWRITE), "reference", ACCEPT, None),
    ("ref-tiny-fp32-cpu-not-interpreted", lambda: on(CPU_NOT_INTERPRETED, dtype="float32"), "reference", ACCEPT, None),
    ("ref-sm75", lambda: on(SM75), "reference", ACCEPT, None),
    ("ref-cuda-graphs", lambda: deploy("qwen3-30b-a3b", cuda_graphs=True), "reference", REFUSE, "cuda_graphs"),
    # triton: sm80+, interpreted on cpu, R <= 128, LoRA unsharded, tp-sharded or fully sharded.
    ("triton-qwen3-tp4-lora-graphs", lambda: deploy("qwen3-30b-a3b", tp=4, lora=True, cuda_graphs=True), "triton", ACCEPT, None),
    ("triton-relu2-sm103", lambda: deploy("nemotron-h", "sm103", lora=True, cuda_graphs=True), "triton", ACCEPT, None),
    ("triton-gpt-oss-bias", lambda: deploy("gpt-oss-20b", "b200", lora=True), "triton", ACCEPT, None),
    ("triton-llama4-weights-on-input", lambda: deploy("llama4-scout", "h100"), "triton", ACCEPT, None),
    ("triton-tiny-cpu-interpreted", lambda: deploy("tiny", "cpu", lora=True), "triton", ACCEPT, None),
    ("triton-a100", lambda: deploy("mixtral-8x7b", "a100", tp=2, ep=4), "triton", ACCEPT, None),
    ("triton-cpu-not-interpreted", lambda: on(CPU_NOT_INTERPRETED), "triton", REFUSE, "device.interpreted"),
    ("triton-sm75", lambda: on(SM75), "triton", REFUSE, "device.compute_capability"),
    ("triton-no-triton-package", lambda: on(H200_WITHOUT_TRITON), "triton", REFUSE, "device.packages"),
    ("triton-rank-256", lambda: deploy("qwen3-30b-a3b", lora=True, rank=256), "triton", ACCEPT, None),
    ("triton-rank-512", lambda: deploy("qwen3-30b-a3b", lora=True, rank=512), "triton", REFUSE, "lora.max_rank"),
    ("triton-fully-sharded", lambda: deploy("qwen3-30b-a3b", tp=4, lora=True, fully_sharded=True), "triton", ACCEPT, None),  # SPEC "Why it exists" #2
    ("triton-fully-sharded-overwrite", lambda: deploy("qwen3-30b-a3b", tp=2, lora=True, fully_sharded=True, add_inputs=AddInputs.OVERWRITE), "triton", ACCEPT, None),
    ("triton-fully-sharded-attention-only", lambda: deploy("qwen3-30b-a3b", tp=4, lora=True, fully_sharded=True, targets=("q_proj",)), "triton", ACCEPT, None),
    # grouped_mm: cuda sm90+, bf16, I_p and H multiples of 8, at most 1023 groups, eager only.
    ("gmm-qwen3-tp4-lora", lambda: deploy("qwen3-30b-a3b", tp=4, lora=True), "grouped_mm", ACCEPT, None),
    ("gmm-relu2-sm103", lambda: deploy("nemotron-h", "sm103", lora=True), "grouped_mm", ACCEPT, None),
    ("gmm-gpt-oss-bias", lambda: deploy("gpt-oss-20b", "b200", lora=True), "grouped_mm", ACCEPT, None),
    ("gmm-2048-experts-ep4", lambda: resized(deploy("qwen3-30b-a3b", ep=4), num_experts=2048), "grouped_mm", ACCEPT, None),  # E_l = 512 groups
    ("gmm-2048-experts-ep2", lambda: resized(deploy("qwen3-30b-a3b", ep=2), num_experts=2048), "grouped_mm", REFUSE, "num_groups"),  # E_l = 1024
    ("gmm-cuda-graphs", lambda: deploy("qwen3-30b-a3b", cuda_graphs=True), "grouped_mm", REFUSE, "cuda_graphs"),
    ("gmm-a100", lambda: deploy("qwen3-30b-a3b", "a100"), "grouped_mm", REFUSE, "device.compute_capability"),
    ("gmm-cpu", lambda: deploy("qwen3-30b-a3b", "cpu"), "grouped_mm", REFUSE, "device.kind"),
    ("gmm-fp16", lambda: deploy("qwen3-30b-a3b", dtype="float16"), "grouped_mm", REFUSE, "dtype"),
    ("gmm-fully-sharded", lambda: deploy("qwen3-30b-a3b", tp=4, lora=True, fully_sharded=True), "grouped_mm", REFUSE, "lora.sharding"),  # the sharding, not add_inputs
    ("gmm-i_p-4", lambda: deploy("tiny", tp=8, dtype="bf16"), "grouped_mm", REFUSE, "intermediate_per_partition"),  # I = 32 / 8
    ("gmm-h-100", lambda: resized(deploy("qwen3-30b-a3b"), hidden_size=100), "grouped_mm", REFUSE, "hidden_size"),
    ("gmm-1024-groups", lambda: resized(deploy("qwen3-30b-a3b"), num_experts=1024), "grouped_mm", REFUSE, "num_groups"),
]  # fmt: skip


@pytest.mark.parametrize(
    "make, backend, verdict, field",
    [pytest.param(*row[1:], id=row[0]) for row in TABLE],
)
def test_capability_table(make, backend, verdict, field):
    assert backend in REGISTRY, f"backend {backend} is not registered"
    reasons = check(REGISTRY[backend].capabilities, make())
    if verdict == ACCEPT:
        assert reasons == []
    else:
        assert fields(reasons) == {field}, reasons


def test_every_registered_backend_has_table_rows():
    # A backend registered without rows here would be chosen on capabilities nobody checked.
    assert set(REGISTRY) <= {row[2] for row in TABLE}


def test_every_registered_backend_has_refusal_rows():
    # Each record states at least one limit, and a row proves the oracle reads it.
    refused = {row[2] for row in TABLE if row[3] == REFUSE}
    assert set(REGISTRY) <= refused
