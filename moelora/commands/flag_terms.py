"""Errors in the words a command's user typed.

Inside the package a LoRA bank's sizes have one name each, the Python keywords `num_slots`
(L) and `max_rank` (R), and an error raised there names them. A command's user typed vLLM's
flags instead (`--max-loras`, `--max-lora-rank`): the command prints the error with those.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# The keyword each of vLLM's LoRA size flags sets (plan, generate, serve, run-batch).
VLLM_LORA_FLAGS = {"num_slots": "--max-loras", "max_rank": "--max-lora-rank"}


def in_flag_terms(message: str, flags: Mapping[str, str]) -> str:
    """`message` with each keyword of `flags` spelled as its flag. A field path such as
    `lora.max_rank` (an oracle reason) or a longer word (`max_ranks`) stays as it is."""
    for keyword, flag in flags.items():
        message = re.sub(rf"(?<![\w.]){re.escape(keyword)}(?!\w)", flag, message)
    return message
