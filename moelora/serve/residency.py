"""Adapter residency as Prometheus families: which loaded adapter is in a device slot (and
which slot), which waits in host memory, and how many slots there are, read from the
handle when /metrics is scraped.

The shape is the one vLLM's pending residency metrics take (vllm-project/vllm#54830:
`vllm:lora_adapter_loaded{adapter_name, level="gpu"|"cpu", pinned}`,
`vllm:num_gpu_loaded_lora_adapters`, `vllm:max_gpu_lora_adapters`) under moelora's prefix,
so a router that reads those (llm-d's lora-load-state-scorer, whose metric names are
configurable) reads these: `level="gpu"` is an adapter in a slot of the device's banks (the
CPU on a CPU-only server), `level="cpu"` one parsed in host memory, copied into a slot when
a request needs it. One series per loaded adapter and one per slot: bounded by the server's
configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from .exposition import family


@dataclass(frozen=True)
class Resident:
    """A loaded adapter: its slot (None: in host memory only) and whether it is pinned."""

    name: str
    slot: int | None
    pinned: bool


def residents(handle) -> list[Resident]:
    """Every adapter loaded now (moelora.hf's handle), by name. A name replaced or unloaded
    while rows still run on its old version is not listed (no request can name it)."""
    in_slot = handle.registry.manager.loaded  # slot-manager key -> slot
    out = []
    for name in handle.adapters:
        version = handle.version(name)
        if version is not None:  # None: unloaded since the list was read
            out.append(Resident(name, in_slot.get(version.key), version.pinned))
    return out


def residency_lines(handle, max_loras: int) -> list[str]:
    loaded = residents(handle)
    stats = handle.stats()
    gpu = [r for r in loaded if r.slot is not None]
    lines = family(
        "moelora_lora_adapter_loaded", "gauge",
        "Loaded adapters: level gpu = in a device slot, cpu = in host memory.",
        [((("adapter_name", r.name), ("level", "cpu" if r.slot is None else "gpu"),
           ("pinned", str(r.pinned).lower())), 1) for r in loaded],
    )  # fmt: skip
    lines += family("moelora_lora_slot_info", "gauge", "The adapter each occupied slot holds.",
                    [((("slot", str(r.slot)), ("adapter_name", r.name)), 1)
                     for r in sorted(gpu, key=lambda r: r.slot)])  # fmt: skip
    lines += family("moelora_num_gpu_loaded_lora_adapters", "gauge",
                    "Loaded adapters in a device slot.", [((), len(gpu))])  # fmt: skip
    lines += family("moelora_num_cpu_loaded_lora_adapters", "gauge",
                    "Loaded adapters in host memory only.", [((), len(loaded) - len(gpu))])  # fmt: skip
    lines += family(
        "moelora_max_gpu_lora_adapters", "gauge", "Adapter slots (--max-loras).", [((), max_loras)]
    )
    lines += family("moelora_lora_registered_adapters", "gauge", "Adapter versions the slot "
                    "manager knows (loaded names, and replaced or unloaded ones still in use).",
                    [((), stats.registered)])  # fmt: skip
    lines += family(
        "moelora_lora_host_cache_adapters",
        "gauge",
        "Adapters in the host cache (--max-cpu-loras).",
        [((), stats.host_adapters)],
    )
    return lines
