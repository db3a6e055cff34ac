"""Errors in the words a command's user typed.

Inside the package a LoRA bank's sizes have one name each, the Python keywords `num_slots`
(L) and `max_rank` (R), and an error raised there names them. A command's user typed vLLM's
flags instead (`--max-loras`, `--max-lora-rank`): the command prints the error with those.

An oracle refusal carries its nearest deployments as data, each change in `moelora plan`'s
flags (moelora.nearest); every other command has only some of them. `error_text` restates
each change with the flags the command has: `--device NAME` becomes the machine to run on,
and a deployment that needs a flag the command lacks (-tp, --lora-add-inputs, ...) is left
out, so that a fix line never names a flag the user cannot pass.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from ..device import TARGETS
from ..errors import MoeloraError, UnsupportedDeploymentError

# The keyword each of vLLM's LoRA size flags sets (plan, generate, serve, run-batch).
VLLM_LORA_FLAGS = {"num_slots": "--max-loras", "max_rank": "--max-lora-rank"}

_DEVICE = re.compile(r"^--device (\S+)(.*)$")
_FLAG = re.compile(r"(?<!\S)--?[a-z][\w-]*")  # a flag in a change: -tp, --dtype, ...


def in_flag_terms(message: str, flags: Mapping[str, str]) -> str:
    """`message` with each keyword of `flags` spelled as its flag. A field path such as
    `lora.max_rank` (an oracle reason) or a longer word (`max_ranks`) stays as it is."""
    for keyword, flag in flags.items():
        message = re.sub(rf"(?<![\w.]){re.escape(keyword)}(?!\w)", flag, message)
    return message


def error_text(err: MoeloraError, flags: Collection[str], keywords: Mapping[str, str]) -> str:
    """`err` as a command prints it: a refusal's fixes in the command's `flags` (its option
    strings), then `keywords` (VLLM_LORA_FLAGS) spelled as flags."""
    if isinstance(err, UnsupportedDeploymentError):
        err = refusal_in_flags(err, flags)
    return in_flag_terms(str(err), keywords)


def refusal_in_flags(
    err: UnsupportedDeploymentError, flags: Collection[str]
) -> UnsupportedDeploymentError:
    """The refusal with its nearest deployments restated with `flags`; a deployment one of
    whose changes needs a flag outside `flags` is left out."""
    nearest = []
    for backend, changes in err.nearest:
        restated = [_change_in_flags(change, flags) for change in changes]
        if all(change is not None for change in restated):
            nearest.append((backend, tuple(restated)))
    return UnsupportedDeploymentError(err.requested, err.reasons, err.accepting, nearest)


def run_on(target: str) -> str:
    """A `--device NAME` change for a command without --device: the machine to run it on."""
    kind, label, _ = TARGETS[target]
    if kind == "cpu":
        return "run on a CPU"
    return f"run on an {label}" + ("" if label.startswith("NVIDIA") else " GPU")


def _change_in_flags(change: str, flags: Collection[str]) -> str | None:
    """One change as a command with `flags` states it, or None when it needs another flag.
    Text that names no flag (export ..., pip install ..., a change a command restated
    itself) stays as it is."""
    device = _DEVICE.match(change)
    if device and "--device" not in flags and device[1] in TARGETS:
        rest = device[2].strip()  # --enforce-eager, when the backend is not graph-safe
        change = run_on(device[1]) + (f" with {rest}" if rest else "")
    if any(flag not in flags for flag in _FLAG.findall(change)):
        return None
    return change
