"""`attach(model, ...)`: moelora serves the routed experts of a transformers model while every
row of a batch uses its own adapter; the returned handle owns the slot banks.

The model keeps its own routing, attention and everything else. Per MoE layer the handle
binds a MoELoRALayer whose weights are views of the module's own expert tensors (no copy),
all sharing one oracle verdict (asked once per layer type, logged once). Adapters are PEFT
directories: the expert factors go into the slot banks (SlotManager), the other modules
into PEFT's own LoRA layers (peft_modules.py). Each load gets an internal version name, so a
call holds the versions it started with (one lease over the call) while loads, replaces and
unloads go on. Legend: B rows, L slots (max_loras), R max rank (max_lora_rank).
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import LoRAConfig, ModelConfig, from_hf
from ..deployment import Deployment
from ..device import probe_device
from ..errors import AdapterError, ConfigError, InputError
from ..layer import MoELoRALayer
from ..lora import SlotManager, load_adapter
from ..lora.leases import BankSnapshot
from ..lora.safe_io import read_config, read_tensors
from ..oracle import Selection, select
from . import batch, experts
from .graphs import MAX_GRAPH_TOKENS, LayerGraphs
from .llama4 import swap_llama4_blocks
from .peft_modules import NonExpertPart, PeftModules, read_non_expert
from .weights import expert_weights_from_hf

log = logging.getLogger("moelora.hf")

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class _Version:
    """One load of one adapter name: its slot-manager name (None: no expert factors) and its
    PEFT adapter name (None: no non-expert modules)."""

    public: str
    internal: str
    in_slots: bool  # has expert factors: registered with the slot manager under `internal`
    peft: bool
    rank: int
    modules: tuple[str, ...]
    pinned: bool


@dataclass(frozen=True)
class AdapterHold:
    """One adapter version held for a row (MoELoRAModel.hold): its slot (-1: none), its PEFT
    name (batch.BASE: none) and the banks its slot indexes; release() exactly once."""

    name: str | None
    key: str | None  # the version's slot-manager name (None: no expert factors)
    slot: int
    peft_name: str
    snapshot: BankSnapshot
    release: Callable[[], None]


def attach(
    model: nn.Module,
    *,
    max_loras: int,
    max_lora_rank: int,
    moe_backend: str = "auto",
    fully_sharded_loras: bool = False,
    enforce_eager: bool | None = None,
    max_cpu_loras: int | None = None,
    max_graph_tokens: int = MAX_GRAPH_TOKENS,
    load_timeout_s: float = 30.0,
) -> MoELoRAModel:
    """Serve `model`'s routed experts with moelora; returns the handle (MoELoRAModel).

    max_loras (L) adapters fit in the slots at once, each of rank <= max_lora_rank (R).
    moe_backend: "auto" or a backend name; an explicit one is honoured or refused here,
    before anything is allocated. enforce_eager: True allows eager-only backends on a GPU;
    default: CUDA-graph safe backends on a GPU (vLLM's default), anything on a CPU.
    fully_sharded_loras: accepted for vLLM compatibility; a no-op in one process (tp = 1).
    More adapters than max_loras may be loaded: the slots hold the most recently used, the
    others wait in host memory (max_cpu_loras bounds the pinned copies kept ready, vLLM's
    --max-cpu-loras) and are copied in when a call names them.
    max_graph_tokens: on a GPU (unless enforce_eager), each MoE layer replays a CUDA graph of
    itself for calls of at most this many tokens (decode), captured at a shape's second call: an eager
    decode step is otherwise bound by Triton's Python launch cost. 0 turns it off.
    The model is put in eval mode: moelora serves inference (no autograd through experts).
    """
    model_config = _model_config(model)
    modules = _experts_modules(model, model_config)
    first = next(iter(modules.values()))
    param = first.down_proj
    device, dtype = param.device, param.dtype
    if fully_sharded_loras:
        log.info("fully_sharded_loras: a no-op in one process (tp = 1), as in vLLM")
    deployment = Deployment.for_model(
        model_config,
        dtype=dtype,
        device=probe_device(device),
        lora=LoRAConfig(
            enabled=True, max_rank=max_lora_rank, max_loras=max_loras, targets=("experts",)
        ),
        cuda_graphs=device.type == "cuda" and not enforce_eager,
        backend=moe_backend,
    )
    selection = select(deployment)  # one verdict for the model's one MoE layer type
    layers = {
        index: MoELoRALayer(
            deployment,
            expert_weights_from_hf(module, model_config, in_place=True),
            selection=selection,
            check_values=False,  # the model's router gives the ids: no host sync per layer
        )
        for index, module in modules.items()
    }
    manager = SlotManager(
        model_config,
        max_loras,
        max_lora_rank,
        device=device,
        dtype=dtype,
        load_timeout_s=load_timeout_s,
        max_cpu_loras=max_cpu_loras,
    )
    experts.register()
    for index, module in modules.items():
        first = index == min(modules)
        graphs = (
            LayerGraphs(max_graph_tokens) if deployment.cuda_graphs and max_graph_tokens else None
        )
        experts.bind(module, experts.ExpertsBinding(layers[index], index, first, graphs))
    previous = getattr(model.config, "_experts_implementation", None)
    swapped = swap_llama4_blocks(model, model_config)
    if not swapped:
        model.set_experts_implementation(experts.NAME)
    model.eval()
    handle = MoELoRAModel(model, model_config, selection, manager, device)
    handle._bound = (list(modules.values()), swapped, previous)
    handle.enforce_eager = enforce_eager  # the decode engine's graphs follow it
    return handle


def _model_config(model: nn.Module) -> ModelConfig:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ConfigError(
            "model",
            type(model).__name__,
            "a transformers PreTrainedModel (with .config)",
            "pass the model AutoModelForCausalLM returned",
        )
    return from_hf(config.to_dict(), name=getattr(config, "model_type", None))


def _experts_modules(model: nn.Module, model_config: ModelConfig) -> dict[int, nn.Module]:
    """MoE layer index -> the routed-experts module (fused 3-D weights), checked against the
    config's MoE layers."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        if not name.endswith("experts") or not isinstance(down, torch.Tensor) or down.dim() != 3:
            continue
        match = _LAYER_INDEX.search(name + ".")
        if match is None:
            continue
        if getattr(module, "_is_expert_parallel", False) or getattr(
            module, "has_post_expert_norm", False
        ):
            raise ConfigError(
                f"{name}",
                "expert parallel or a post-expert norm",
                "plain routed experts in one process",
                "load the model without transformers' expert parallel plan",
            )
        found[int(match.group(1))] = module
    want = tuple(model_config.moe_layers)
    if tuple(sorted(found)) != want:
        raise ConfigError(
            "model",
            f"routed-experts modules in layers {sorted(found)}",
            f"the MoE layers {list(want)} that its config describes",
            "pass a model built from its own config (fused 3-D expert weights, transformers 5)",
        )
    params = {(m.down_proj.device, m.down_proj.dtype) for m in found.values()}
    if len(params) != 1:
        raise ConfigError(
            "model",
            f"experts on {sorted(map(str, params))}",
            "every MoE layer on one device in one dtype",
            "move the model with model.to(device, dtype) first",
        )
    return found


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
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.selection = selection
        self.device = device
        self._manager = manager
        self._peft = PeftModules(model)
        self._versions: dict[str, _Version] = {}  # public name -> current version
        self._refs: Counter[str] = Counter()  # internal name -> calls holding it
        self._retired: dict[str, _Version] = {}  # replaced or unloaded, still held
        self._lock = threading.Lock()  # writers, and the start of a call
        self._refs_lock = threading.Lock()
        self._seq = itertools.count()
        self._bound: tuple[list, list, str | None] = ([], [], None)
        self._local = threading.local()
        self.enforce_eager: bool | None = None
        self.use_engine = True

    # ---- facts --------------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        """Names of the loaded adapters, sorted."""
        return sorted(self._versions)

    @property
    def backend_name(self) -> str:
        return self.selection.name

    @property
    def max_loras(self) -> int:
        return self._manager.num_slots

    @property
    def max_lora_rank(self) -> int:
        return self._manager.max_rank

    def describe(self, name: str) -> dict[str, Any]:
        """What is loaded under `name`: rank, slot or not, non-expert modules."""
        v = self._known(name)
        return {"name": name, "rank": v.rank, "experts": v.in_slots, "modules": list(v.modules)}

    # ---- adapters -------------------------------------------------------------------------

    def load_adapter(
        self,
        path: str | Path,
        name: str | None = None,
        pin: bool = False,
        *,
        fused_orientation: str | None = None,
    ) -> str:
        """Load a PEFT adapter directory under `name` (default: the directory's name); a name
        already loaded is replaced (calls running keep the old version). Every check runs
        before anything is written: a refused adapter changes nothing. Returns the name.
        fused_orientation: "natural" (PEFT 0.21) or "swapped" (PEFT 0.17), only for fused
        target_parameters files whose shapes read both ways (the error says when)."""
        root = Path(path)
        name = name if name is not None else root.resolve().name
        if not isinstance(name, str) or not name or name == batch.BASE:
            raise InputError(
                "name", repr(name), f"a non-empty adapter name other than {batch.BASE!r}"
            )
        internal = f"moelora{next(self._seq)}"
        adapter = load_adapter(
            root,
            self.model_config,
            self.max_lora_rank,
            name=internal,
            fused_orientation=fused_orientation,
            serves_non_expert=True,
        )
        config = read_config(root)
        file, tensors = read_tensors(root)
        part = read_non_expert(str(file), config, tensors, self.model)
        if not adapter.layers and part is None:
            raise AdapterError(
                str(file),
                "<modules>",
                "no LoRA factor on a module this model runs",
                "LoRA on the routed experts or on nn.Linear modules of the model",
                "check target_modules / target_parameters against the model's module names",
            )
        version = _Version(
            name,
            internal,
            in_slots=bool(adapter.layers),
            peft=part is not None,
            rank=adapter.rank,
            modules=tuple(part.modules) if part is not None else (),
            pinned=pin or (name in self._versions and self._versions[name].pinned),
        )
        with self._lock:
            old = self._versions.get(name)
            if old is not None and old.in_slots and self._slots_full() and version.in_slots:
                # Full slots: free the old version's own slot first (when no call holds it,
                # the new version takes it; else the manager evicts the LRU adapter).
                self._retire(old)
                old = None
                del self._versions[name]
            self._write(version, adapter, part)
            self._versions[name] = version
            if old is not None:
                self._retire(old)
        log.info(
            "adapter %s loaded: rank %d, experts %s, %d other modules (%s)",
            name,
            version.rank,
            "yes" if version.in_slots else "no",
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

    def _write(self, version: _Version, adapter, part: NonExpertPart | None) -> None:
        """Register the expert factors (a call naming them copies them into a slot if they
        are in none) and load them now when a slot is free or they are pinned; inject the
        other modules into PEFT. On failure, both are undone."""
        try:
            if version.in_slots:
                self._manager.register(version.internal, adapter)
                if version.pinned or not self._slots_full():
                    self._manager.load(adapter, name=version.internal, pin=version.pinned)
            if part is not None:
                self._peft.inject(version.internal, part)
        except Exception:
            if version.in_slots and version.internal in self._manager.registered:
                self._manager.unregister(version.internal)
            raise

    def _slots_full(self) -> bool:
        return len(self._manager.loaded) >= self._manager.num_slots

    def _retire(self, version: _Version) -> None:
        """Under self._lock: the version leaves the slots now (a slot a call still holds is
        kept by the manager until released) and PEFT once no call holds it."""
        if version.in_slots:
            self._manager.unregister(version.internal)  # a held slot stays until released
        with self._refs_lock:
            if self._refs[version.internal]:
                self._retired[version.internal] = version
                return
        if version.peft:
            self._peft.delete(version.internal)

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
        if self.use_engine:
            from . import engine_generate  # imports transformers' cache classes

            out = engine_generate.generate(
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
        """Hold the current version of every named adapter for the block (one slot lease,
        one PEFT reference each) and make the per-row adapters current for this thread."""
        with self._lock:
            versions = [None if n is None else self._known(n) for n in names]
            slot_names = [v.internal if v is not None and v.in_slots else None for v in versions]
            reading = self._manager.reading(slot_names, device=self.device)
            snapshot, fresh_slots = reading.__enter__()
            held = {v.internal for v in versions if v is not None}
            with self._refs_lock:
                self._refs.update(held)
        try:
            row_slots, token_buffer = self._buffers(len(names), tokens)
            row_slots.copy_(fresh_slots)
            rows = batch.RowAdapters(
                row_slots=row_slots,
                token_buffer=token_buffer,
                snapshot=snapshot,
                peft_names=tuple(
                    v.internal if v is not None and v.peft else batch.BASE for v in versions
                ),
                expert_lora=any(s is not None for s in slot_names),
            )
            with batch.using(rows):
                yield rows
        finally:
            reading.__exit__(None, None, None)
            self._release(held)

    def hold(self, name: str | None) -> AdapterHold:
        """Hold the current version of `name` (None: the base model) until the returned
        hold's release(): its slot lease (a registered adapter in no slot is loaded first) and
        its PEFT modules. For callers whose rows outlive one call (the decode engine)."""
        with self._lock:
            version = None if name is None else self._known(name)
            slot_name = version.internal if version is not None and version.in_slots else None
            reading = self._manager.reading([slot_name], device=self.device)
            snapshot, slots = reading.__enter__()
            held = {version.internal} if version is not None else set()
            with self._refs_lock:
                self._refs.update(held)
        peft = version.internal if version is not None and version.peft else batch.BASE
        slot = int(slots[0])

        def release() -> None:
            reading.__exit__(None, None, None)
            self._release(held)

        return AdapterHold(name, slot_name, slot, peft, snapshot, release)

    def slot_key(self, name: str | None) -> str | None:
        """The slot-manager name of `name`'s current version (None: it needs no slot)."""
        version = None if name is None else self._versions.get(name)
        return version.internal if version is not None and version.in_slots else None

    def _release(self, held: set[str]) -> None:
        done = []
        with self._refs_lock:
            self._refs.subtract(held)
            for internal in held:
                if self._refs[internal] <= 0:
                    del self._refs[internal]
                    if internal in self._retired:
                        done.append(self._retired.pop(internal))
        for version in done:
            if version.peft:
                self._peft.delete(version.internal)

    def detach(self) -> None:
        """Give the model back: its experts run transformers' implementation again (the one
        set before attach), Llama 4 blocks are restored. Loaded PEFT modules stay."""
        modules, swapped, previous = self._bound
        for module in modules:
            experts.unbind(module)
        for parent, attr, original in swapped:
            setattr(parent, attr, original)
        if not swapped and previous not in (None, experts.NAME):
            self.model.set_experts_implementation(previous)
        self._bound = ([], [], previous)


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
