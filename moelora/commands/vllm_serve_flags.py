"""`vllm serve` flags users paste into `moelora serve` that have no meaning here: each is
refused while the command line is parsed (exit 2) with the reason, rather than reported as
an unknown argument or silently ignored. The flags that have a meaning are `serve`'s own
(commands/serve.py), under vLLM's names."""

from __future__ import annotations

import argparse

ONE_GPU = "moelora serve runs one engine on one GPU; run one server per GPU instead"

# flag (and its short forms) -> why moelora serve has no such setting
REFUSED: dict[tuple[str, ...], str] = {
    ("--tensor-parallel-size", "-tp"): ONE_GPU,
    ("--pipeline-parallel-size", "-pp"): ONE_GPU,
    ("--data-parallel-size", "-dp"): ONE_GPU,
    ("--enable-expert-parallel",): ONE_GPU,
    ("--fully-sharded-loras",): ONE_GPU + " (nothing is sharded on one GPU)",
    ("--quantization", "-q"): "the experts' format is read from the checkpoint's config.json "
    "(quantization_config; FP8 experts: docs/fp8.md)",
    ("--kv-cache-dtype",): "the KV cache is kept in the model's dtype",
    ("--swap-space",): "no KV cache is swapped to host memory",
    ("--trust-remote-code",): "models are built with transformers' own classes; no code from "
    "the model directory is run",
    ("--lora-dtype",): "adapter banks are kept in the model's dtype",
    ("--lora-extra-vocab-size",): "adapters that add tokens are not served",
    ("--long-lora-scaling-factors",): "LongLoRA adapters are not served",
    ("--speculative-config",): "no speculative decoding",
}


class _Refused(argparse.Action):
    def __init__(self, option_strings, dest, why: str = "", **kwargs) -> None:
        self.why = why
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string}: a vLLM flag moelora serve does not take: {self.why}")


def add_refused(p: argparse.ArgumentParser) -> None:
    """Every REFUSED flag, hidden from --help, refused with its reason when given."""
    for flags, why in REFUSED.items():
        p.add_argument(*flags, action=_Refused, why=why, dest=f"_refused{flags[0]}")
