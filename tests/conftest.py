"""Shared test setup. Triton kernels run through the interpreter on machines without a GPU;
the variable must be set before any kernel module is imported."""

import os
import random
import signal
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# kernel workspaces start as NaN: a kernel reading a row nobody wrote fails the test
os.environ.setdefault("MOELORA_POISON_WORKSPACES", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# A suite started in the background by a non-interactive shell (`cmd &`) inherits SIGINT
# ignored, and so would every process it starts: the Ctrl-C tests' children would never see
# theirs. Python's own handler again (children get the default at exec).
if (
    signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    and threading.current_thread() is threading.main_thread()
):
    signal.signal(signal.SIGINT, signal.default_int_handler)

# pytest-xdist runs one worker per core: one intra-op thread each avoids oversubscription,
# which made small CPU ops (index_add_ in the reference) ~1000x slower on 2-core machines.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures(...)`), the
    previous count restored after it: torch 2.13's CPU index_add_ (used by the reference)
    takes ~60 ms per call with 2 intra-op threads on these 2-core machines, ~10 us with 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def seed(request) -> int:
    """A fresh random seed per test (MOELORA_SEED=N reproduces one); a failure prints it."""
    value = int(os.environ.get("MOELORA_SEED", random.randrange(2**31)))
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture(scope="module")
def model_seed(request) -> int:
    """A fresh random seed below 1000 for a module's served model (MOELORA_MODEL_SEED=N
    reproduces one; else MOELORA_SEED % 1000 when that is set); a failure prints it."""
    fixed = os.environ.get("MOELORA_MODEL_SEED", os.environ.get("MOELORA_SEED"))
    value = int(fixed) % 1000 if fixed is not None else random.randrange(1000)
    request.module._moelora_model_seed = value
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        env = [f"MOELORA_SEED={value}" for key, value in item.user_properties if key == "seed"]
        model = getattr(item.module, "_moelora_model_seed", None)
        if model is not None:
            env.append(f"MOELORA_MODEL_SEED={model}")
        if env:
            report.sections.append(("seed", f"reproduce with {' '.join(env)}"))
