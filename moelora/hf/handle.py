"""The handle `attach(model, ...)` returns (attach.py): a transformers model whose routed
experts, Linear modules and routers serve every row of a batch with its own adapter.

Adapters are PEFT directories: the expert factors and the Linear modules' factors are read
here (the modules are the model's) and published in one AdapterRegistry (moelora.lora),
which versions them over the slot manager: a call holds the versions it started with while
loads, replaces and unloads go on. `generate` decodes on moelora's engine (moelora.engine)
for the models and settings it supports. Legend: B rows, L slots, R max rank.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import AdapterError, InputError
from ..layer import MoELoRALayer
from ..lora import load_adapter
from ..lora.module_banks import ModuleBanks
from ..lora.refusals import Refusals
from ..lora.registry import AdapterHold, AdapterRegistry, Version
from ..lora.reports import ServingStats
from ..lora.rows import BASE, RowAdapters, using
from ..lora.safe_io import read_config, read_tensors
from ..oracle import Selection
from .bound import Bound
from .call_args import expand_factor, row_names, rows_of
from .module_lora import read_module_factors

log = logging.getLogger("moelora.hf")


class MoELoRAModel:
    """A transformers model whose routed experts run on moelora, one adapter per row.

    Not built directly: `attach(model, ...)` returns it. `generate` and `forward` take
    `adapter_names` (one per row, None or "__base__" = the base model), PEFT's keyword.
    `use_engine = False` makes generate run model.generate always."""

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        selection: Selection,
        registry: AdapterRegistry,
        served: dict[str, nn.Module],
        layers: dict[int, MoELoRALayer],
        bound: Bound,  # what attach changed in the model (attach.py), undone by detach()
        device: torch.device,
        enforce_eager: bool | None,
    ) -> None:
        self.model, self.model_config, self.selection = model, model_config, selection
        self.registry = registry
        self.layers = layers  # MoE layer index -> the MoELoRALayer serving its experts
        self.device = device
        self.enforce_eager = enforce_eager  # the engine's CUDA graphs follow it
        self.use_engine = True
        self._served = served  # path -> the served nn.Linear modules and routers
        self._bound = bound
        self._local = threading.local()

    # ---- facts --------------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        """Names of the loaded adapters, sorted."""
        return self.registry.names

    @property
    def backend_name(self) -> str:
        """The backend the oracle selected for every MoE layer of the model."""
        return self.selection.name

    @property
    def num_slots(self) -> int:
        """L: the adapters the device's slots hold at once (vLLM's --max-loras)."""
        return self.registry.manager.num_slots

    @property
    def max_rank(self) -> int:
        """R: the largest adapter rank the banks hold (vLLM's --max-lora-rank)."""
        return self.registry.manager.max_rank

    @property
    def lora_modules(self) -> frozenset[str]:
        """The served Linear modules / routers some loaded adapter has factors on."""
        return self.registry.lora_modules

    @property
    def module_banks(self) -> ModuleBanks:
        """The served Linear modules' and routers' LoRA banks (the slot manager's)."""
        return self.registry.manager.module_banks

    def version(self, name: str | None) -> Version | None:
        """The current version of `name` (None: the base model or a name not loaded)."""
        return self.registry.version(name)

    @property
    def pinned_keys(self) -> frozenset[str]:
        """The version keys of the pinned adapters (their slots are never free)."""
        versions = (self.registry.version(n) for n in self.registry.pinned)
        return frozenset(v.key for v in versions if v is not None and v.pinned)

    def describe(self, name: str) -> dict[str, Any]:
        """What is loaded under `name`: rank, expert factors or not, pinned, Linear modules."""
        return self.registry.describe(name)

    def stats(self) -> ServingStats:
        """The slot manager's counters: copies into slots, evictions, the host cache."""
        return self.registry.stats()

    # ---- adapters -------------------------------------------------------------------------

    def load_adapter(
        self,
        path: str | Path,
        name: str | None = None,
        pin: bool | None = None,
        *,
        fused_orientation: str | None = None,
    ) -> str:
        """Load a PEFT adapter directory under `name` (default: the directory's name); a name
        already loaded is replaced (calls running keep the old version). Every check runs
        before anything is written: a refused adapter (or a slot wait that times out) changes
        nothing. Returns the name. pin: keep the adapter in its slot (never evicted); None: a
        replacement keeps the replaced version's pin, a new name is not pinned. unpin(name)
        drops it. fused_orientation: "natural" (PEFT 0.21) or "swapped" (PEFT 0.17), only for
        fused target_parameters files whose shapes read both ways (the error says when)."""
        root = Path(path)
        name = name if name is not None else root.resolve().name
        if not isinstance(name, str) or not name or name == BASE:
            raise InputError("name", repr(name), f"a non-empty adapter name other than {BASE!r}")
        refusals = Refusals()  # the experts' and the modules' refusals named together
        # the weights file read once for both (a failed read is not kept: tried again)
        reader = functools.cache(lambda: read_tensors(root))
        with refusals.check():
            adapter = load_adapter(root, self.model_config, self.max_rank, name=name,
                                   fused_orientation=fused_orientation, serves_non_expert=True,
                                   reader=reader, allocate=self.registry.manager.allocate_host)  # fmt: skip
        with refusals.check():
            file, tensors = reader()
            factors = read_module_factors(str(file), read_config(root), tensors, self._served)
        reader.cache_clear()  # the file's tensors: parsed into adapter and factors
        refusals.raise_any()
        if not adapter.layers and not factors:
            raise AdapterError(str(file), "<modules>", "no LoRA factor on a module this model runs",
                               "LoRA on the routed experts or on nn.Linear modules of the model",
                               "check target_modules / target_parameters against the model's "
                               "module names")  # fmt: skip
        version = self.registry.publish(name, dataclasses.replace(adapter, modules=factors), pin)
        log.info("adapter %s loaded: rank %d, experts %s, %d other modules (%s)", name,
                 version.rank, "yes" if version.experts else "no", len(version.modules), root)  # fmt: skip
        return name

    def unload_adapter(self, name: str) -> None:
        """Unload `name`; calls already running keep it until they return."""
        self.registry.unload(name)

    def unpin(self, name: str) -> None:
        """Let `name` be evicted from its slot again (a no-op when it is not pinned)."""
        self.registry.unpin(name)

    def hold(self, names: Sequence[str | None]) -> list[AdapterHold]:
        """Hold the current versions of `names` (None: the base model) at once, one slot
        lease, until each returned hold's release(): for callers whose rows outlive one call
        (the decode engine)."""
        return self.registry.hold(names)

    # ---- calls ------------------------------------------------------------------------------

    def warmup(self, max_batch: int, max_length: int):
        """Build the calling thread's decode engine for up to `max_batch` rows of up to
        `max_length` tokens (prompt and new) and capture its CUDA graphs now, as a server
        does at startup; otherwise the first generate of each size captures what it needs.
        Returns what was captured and how long it took (None without graphs: a CPU, or
        enforce_eager)."""
        from ..engine.generate import warmup

        return warmup(self, max_batch, max_length)

    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        adapter_names: Sequence[str | None] | None = None,
        **generate_kwargs: Any,
    ) -> torch.Tensor:
        """model.generate with one adapter per row of input_ids (None = base model).
        Padding, attention masks, sampling and max_new_tokens work as in model.generate.
        Decoded by the engine (moelora.engine: per-row KV cache, CUDA graphs on a GPU unless
        enforce_eager) for the models and settings it supports; otherwise by model.generate."""
        from ..engine.generate import generate as engine_generate

        rows, width = rows_of(input_ids, generate_kwargs)
        if self.use_engine:
            out = engine_generate(self, input_ids, row_names(adapter_names, rows), generate_kwargs)
            if out is not None:
                return out
        expand = expand_factor(self.model, generate_kwargs)
        names = [n for n in row_names(adapter_names, rows) for _ in range(expand)]
        # the prefill is the largest forward of a generate call: B * expand * S tokens
        with self.call(names, len(names) * width), torch.no_grad():
            if input_ids is not None:
                return self.model.generate(input_ids, **generate_kwargs)
            return self.model.generate(**generate_kwargs)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        adapter_names: Sequence[str | None] | None = None,
        **kwargs: Any,
    ):
        """model(input_ids, ...) with one adapter per row (None = base model)."""
        rows, width = rows_of(input_ids, kwargs)
        with self.call(row_names(adapter_names, rows), rows * width), torch.no_grad():
            return self.model(input_ids=input_ids, **kwargs)

    __call__ = forward

    @contextmanager
    def call(self, names: list[str | None], tokens: int) -> Iterator[RowAdapters]:
        """Hold the current version of every named adapter for the block (one slot lease)
        and make the rows' adapters current for this thread: a model forward inside it
        serves row i with names[i] (at most `tokens` tokens per forward)."""
        holds = self.registry.hold(names)
        try:
            row_slots, token_buffer = self._buffers(len(names), tokens)
            row_slots.copy_(torch.tensor([h.slot for h in holds], dtype=torch.int32))
            rows = RowAdapters(
                row_slots=row_slots, token_buffer=token_buffer, snapshot=holds[0].snapshot,
                expert_lora=any(h.experts for h in holds),
                lora_modules=frozenset().union(*(h.modules for h in holds)),
            )  # fmt: skip
            with using(rows):
                yield rows
        finally:
            for h in holds:
                h.release()

    def _buffers(self, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's kept row-slot [B] and token-slot [>= T] buffers, grown (new tensors:
        a CUDA graph captured before reads the old ones) only when a call needs more."""
        kept = getattr(self._local, "buffers", None)
        if kept is None or kept[0].shape[0] != rows or kept[1].shape[0] < tokens:
            capacity = max(tokens, 0 if kept is None else kept[1].shape[0])
            kept = (torch.empty(rows, dtype=torch.int32, device=self.device),
                    torch.empty(capacity, dtype=torch.int32, device=self.device))  # fmt: skip
            self._local.buffers = kept
        return kept

    def detach(self) -> None:
        """Give the model back: its experts run transformers' implementation again (the one
        set before attach), Llama 4 blocks are restored, the Linear modules' hooks removed."""
        self._bound = self._bound.undo(self.model)
