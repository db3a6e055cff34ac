"""Shared test setup. Triton kernels run through the interpreter on machines without a GPU;
the variable must be set before any kernel module is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# pytest-xdist runs one worker per core: one intra-op thread each avoids oversubscription,
# which made small CPU ops (index_add_ in the reference) ~1000x slower on 2-core machines.
torch.set_num_threads(1)
