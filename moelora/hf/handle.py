"""The handle `attach(model, ...)` returns (attach.py): a transformers model whose routed
experts, Linear modules and routers serve every row of a batch with its own adapter.

Adapters are PEFT directories: the expert factors and the Linear modules' factors go into
the slot banks of one SlotManager, in the same slot. Each load gets an internal version
name, so a call holds the versions it started with (one lease over the call) while loads,
replaces and unloads go on. Legend: B rows, L slots (num_slots), R max rank (max_rank).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import AdapterError, InputError
from ..lora import SlotManager, load_adapter
from ..lora.refusals import Refusals
from ..lora.safe_io import read_config, read_tensors
from ..oracle import Selection
from . import batch, experts
from .module_lora import ModuleHooks, read_module_factors

log = logging.getLogger("moelora.hf")


@dataclass(frozen=True)
class _Version:
    """One load of one adapter name, registered with the slot manager under `internal`."""

    public: str
    internal: str
    experts: bool  # has expert factors
    rank: int
    modules: tuple[str, ...]
    pinned: bool


class MoELoRAModel:
    """A transformers model whose routed experts run on moelora, one adapter per row.

    Not built directly: `attach(model, ...)` returns it. `generate` and `forward` take
    `adapter_names` (one per row, None or "__base__" = the base model), PEFT's keyword.
    """

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        selection: Selection,
        manager: SlotManager,
        device: torch.device,
        served: dict[str, nn.Module],
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.selection = selection
        self.device = device
        self._manager = manager
        self._served = served  # path -> the served nn.Linear modules and routers
        self._versions: dict[str, _Version] = {}  # public name -> current version
        self._lock = threading.Lock()  # writers, and the start of a call
        self._seq = itertools.count()
        self._bound: tuple[list, list, str | None, ModuleHooks | None] = ([], [], None, None)
        self._local = threading.local()
        self.enforce_eager: bool | None = None  # set by attach: the engine's graphs follow it
        self.use_engine = True
        # set by attach: engine_generate.generate (the engine imports this module, so this
        # module never imports the engine)
        self.engine_generate: Callable[..., torch.Tensor | None] | None = None

    # ---- facts --------------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        """Names of the loaded adapters, sorted."""
        return sorted(self._versions)

    @property
    def backend_name(self) -> str:
        """The backend the oracle selected for every MoE layer of the model."""
        return self.selection.name

    @property
    def num_slots(self) -> int:
        """L: the adapters the device's slots hold at once (vLLM's --max-loras)."""
        return self._manager.num_slots

    @property
    def max_rank(self) -> int:
        """R: the largest adapter rank the banks hold (vLLM's --max-lora-rank)."""
        return self._manager.max_rank

    @property
    def lora_modules(self) -> frozenset[str]:
        """The served Linear modules / routers some loaded adapter has factors on."""
        return frozenset(p for v in list(self._versions.values()) for p in v.modules)

    def describe(self, name: str) -> dict[str, Any]:
        """What is loaded under `name`: rank, expert factors or not, pinned, Linear modules."""
        v = self._known(name)
        return {
            "name": name,
            "rank": v.rank,
            "experts": v.experts,
            "pinned": v.pinned,
            "modules": list(v.modules),
        }

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
        before anything is written, and the old version is retired only once the new one is
        in: a refused adapter (or a slot wait that times out) changes nothing. Returns the name.
        pin: keep the adapter in its slot (never evicted); None: a replacement keeps the
        replaced version's pin (logged), a new name is not pinned. unpin(name) drops it.
        fused_orientation: "natural" (PEFT 0.21) or "swapped" (PEFT 0.17), only for fused
        target_parameters files whose shapes read both ways (the error says when)."""
        root = Path(path)
        name = name if name is not None else root.resolve().name
        if not isinstance(name, str) or not name or name == batch.BASE:
            raise InputError(
                "name", repr(name), f"a non-empty adapter name other than {batch.BASE!r}"
            )
        internal = f"moelora{next(self._seq)}"
        refusals = Refusals()  # the experts' and the modules' refusals named together
        with refusals.check():
            adapter = load_adapter(
                root,
                self.model_config,
                self.max_rank,
                name=internal,
                fused_orientation=fused_orientation,
                serves_non_expert=True,
            )
        with refusals.check():
            file, tensors = read_tensors(root)
            factors = read_module_factors(str(file), read_config(root), tensors, self._served)
        refusals.raise_any()
        if not adapter.layers and not factors:
            raise AdapterError(
                str(file),
                "<modules>",
                "no LoRA factor on a module this model runs",
                "LoRA on the routed experts or on nn.Linear modules of the model",
                "check target_modules / target_parameters against the model's module names",
            )
        with self._lock:
            old = self._versions.get(name)
            version = _Version(
                name,
                internal,
                experts=bool(adapter.layers),
                rank=max([adapter.rank, *(f.rank for f in factors.values())]),
                modules=tuple(sorted(factors)),
                pinned=self._pin_for(name, old, pin),
            )
            self._replace(old, version, dataclasses.replace(adapter, modules=factors))
        log.info(
            "adapter %s loaded: rank %d, experts %s, %d other modules (%s)",
            name,
            version.rank,
            "yes" if version.experts else "no",
            len(version.modules),
            root,
        )
        return name

    def unload_adapter(self, name: str) -> None:
        """Unload `name`; calls already running keep it until they return."""
        with self._lock:
            version = self._known(name)
            del self._versions[name]
            self._retire(version)

    def unpin(self, name: str) -> None:
        """Let `name` be evicted from its slot again (a no-op when it is not pinned)."""
        with self._lock:
            version = self._known(name)
            self._manager.unpin(version.internal)
            self._versions[name] = dataclasses.replace(version, pinned=False)

    def _pin_for(self, name: str, old: _Version | None, pin: bool | None) -> bool:
        """Under self._lock: the new version's pin (see load_adapter's `pin`)."""
        if pin is not None:
            return pin
        if old is not None and old.pinned:
            log.info("adapter %s: the replacement keeps the pin (unpin(%r) drops it)", name, name)
            return True
        return False

    def _replace(self, old: _Version | None, version: _Version, adapter) -> None:
        """Under self._lock: write `version`, then publish it and retire `old`. A pinned old
        version is unpinned during the write (with every slot full, its slot may be the one
        the new version takes); if the write fails it is pinned again, still in its slot."""
        repin = old is not None and old.pinned
        if repin:
            self._manager.unpin(old.internal)
        try:
            self._write(version, adapter)
        except BaseException:
            if repin and old.internal in self._manager.loaded:
                self._manager.pin(old.internal)
            raise
        self._versions[version.public] = version
        if old is not None:
            self._retire(old)

    def _write(self, version: _Version, adapter) -> None:
        """Register the version (a call naming it copies it into a slot if it is in none) and
        load it now when a slot is free or it is pinned. On failure it is unregistered."""
        try:
            self._manager.register(version.internal, adapter)
            if version.pinned or not self._slots_full():
                self._manager.load(adapter, name=version.internal, pin=version.pinned)
        except BaseException:
            if version.internal in self._manager.registered:
                self._manager.unregister(version.internal)
            raise

    def _slots_full(self) -> bool:
        return len(self._manager.loaded) >= self._manager.num_slots

    def _retire(self, version: _Version) -> None:
        """Under self._lock: the version leaves the slots (a slot a call still holds is kept
        by the manager until released: expert and module banks alike)."""
        self._manager.unregister(version.internal)

    def _known(self, name: str) -> _Version:
        if name not in self._versions:
            raise InputError(
                "adapter name",
                repr(name),
                f"None or a loaded adapter {self.adapters} (load_adapter it first)",
            )
        return self._versions[name]

    # ---- calls ------------------------------------------------------------------------------

    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        adapter_names: Sequence[str | None] | None = None,
        **generate_kwargs: Any,
    ) -> torch.Tensor:
        """model.generate with one adapter per row of input_ids (None = base model).
        Padding, attention masks, sampling and max_new_tokens work as in model.generate.
        Decoded by the engine (hf/engine.py: per-row KV cache, CUDA graphs on a GPU unless
        enforce_eager) for the models and settings it supports (use_engine = False: never);
        otherwise by model.generate."""
        rows, width = _rows(input_ids, generate_kwargs)
        if self.use_engine and self.engine_generate is not None:
            out = self.engine_generate(
                self, input_ids, _names(adapter_names, rows), generate_kwargs
            )
            if out is not None:
                return out
        expand = _expand_factor(self.model, generate_kwargs)
        names = [n for n in _names(adapter_names, rows) for _ in range(expand)]
        # the prefill is the largest forward of a generate call: B * expand * S tokens
        with self._call(names, len(names) * width), torch.no_grad():
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
        rows, width = _rows(input_ids, kwargs)
        names = _names(adapter_names, rows)
        with self._call(names, rows * width), torch.no_grad():
            return self.model(input_ids=input_ids, **kwargs)

    __call__ = forward

    def _buffers(self, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's kept row-slot [B] and token-slot [>= T] buffers, grown (new tensors:
        a CUDA graph captured before reads the old ones) only when a call needs more."""
        kept = getattr(self._local, "buffers", None)
        if kept is None or kept[0].shape[0] != rows or kept[1].shape[0] < tokens:
            capacity = max(tokens, 0 if kept is None else kept[1].shape[0])
            kept = (
                torch.empty(rows, dtype=torch.int32, device=self.device),
                torch.empty(capacity, dtype=torch.int32, device=self.device),
            )
            self._local.buffers = kept
        return kept

    @contextmanager
    def _call(self, names: list[str | None], tokens: int) -> Iterator[batch.RowAdapters]:
        """Hold the current version of every named adapter for the block (one slot lease)
        and make the per-row adapters current for this thread."""
        with self._lock:
            versions = [None if n is None else self._known(n) for n in names]
            reading = self._manager.reading(
                [None if v is None else v.internal for v in versions], device=self.device
            )
            snapshot, fresh_slots = reading.__enter__()
        try:
            row_slots, token_buffer = self._buffers(len(names), tokens)
            row_slots.copy_(fresh_slots)
            rows = batch.RowAdapters(
                row_slots=row_slots,
                token_buffer=token_buffer,
                snapshot=snapshot,
                expert_lora=any(v is not None and v.experts for v in versions),
                lora_modules=frozenset(p for v in versions if v is not None for p in v.modules),
            )
            with batch.using(rows):
                yield rows
        finally:
            reading.__exit__(None, None, None)

    def hold(self, name: str | None) -> batch.AdapterHold:
        """Hold the current version of `name` (None: the base model) until the returned
        hold's release(): its slot lease (a registered adapter in no slot is loaded first).
        For callers whose rows outlive one call (the decode engine)."""
        return self.hold_all([name])[0]

    def hold_all(self, names: Sequence[str | None]) -> list[batch.AdapterHold]:
        """Hold the current versions of all `names` at once (one slot lease over the set, as
        a call takes it: callers that took them one by one could each hold a slot while
        waiting for another's); the lease ends when every returned hold is released."""
        with self._lock:
            versions = [None if n is None else self._known(n) for n in names]
            reading = self._manager.reading(
                [None if v is None else v.internal for v in versions], device=self.device
            )
            snapshot, slots = reading.__enter__()
        left = [len(names)]
        count_lock = threading.Lock()

        def releaser() -> Callable[[], None]:
            released = threading.Event()

            def release() -> None:
                if released.is_set():
                    return
                released.set()
                with count_lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    reading.__exit__(None, None, None)

            return release

        return [
            batch.AdapterHold(
                name,
                None if v is None else v.internal,
                int(slot),
                experts=v is not None and v.experts,
                modules=frozenset(v.modules) if v is not None else frozenset(),
                snapshot=snapshot,
                release=releaser(),
            )
            for name, v, slot in zip(names, versions, slots)
        ]

    def slot_key(self, name: str | None) -> str | None:
        """The slot-manager name of `name`'s current version (None: the base model)."""
        version = None if name is None else self._versions.get(name)
        return None if version is None else version.internal

    def detach(self) -> None:
        """Give the model back: its experts run transformers' implementation again (the one
        set before attach), Llama 4 blocks are restored, the Linear modules' hooks removed."""
        modules, swapped, previous, hooks = self._bound
        if hooks is not None:
            hooks.remove()
        for module in modules:
            experts.unbind(module)
        for parent, attr, original in swapped:
            setattr(parent, attr, original)
        if not swapped and previous not in (None, experts.NAME):
            self.model.set_experts_implementation(previous)
        self._bound = ([], [], previous, None)


def _rows(input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> tuple[int, int]:
    """(B, S) of the call's input."""
    source = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
    if source is None or source.dim() < 2:
        raise InputError(
            "input_ids",
            None if source is None else f"shape {list(source.shape)}",
            "a [B, S] tensor of token ids (or inputs_embeds [B, S, H])",
        )
    return source.shape[0], source.shape[1]


def _names(adapter_names: Sequence[str | None] | None, rows: int) -> list[str | None]:
    if adapter_names is None:
        return [None] * rows
    if isinstance(adapter_names, str) or not isinstance(adapter_names, Sequence):
        raise InputError(
            "adapter_names", repr(adapter_names), f"a list of {rows} names (None = base model)"
        )
    if len(adapter_names) != rows:
        raise InputError(
            "adapter_names",
            f"{len(adapter_names)} names",
            f"one per row of input_ids ({rows} rows; None = the base model)",
        )
    return [None if n in (None, batch.BASE) else n for n in adapter_names]


def _expand_factor(model: nn.Module, kwargs: dict[str, Any]) -> int:
    """Rows generate makes of each input row: max(num_beams, num_return_sequences)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    returns = kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1
    return max(int(beams), int(returns))
