"""The decode engine: continuous batching of requests, each with its own adapter, over a
KV cache (paged on the runner: blocks.py, paged_cache.py; one row of max_len per request on
transformers' forward), with whole decode steps replayed from CUDA graphs on a GPU.

One scheduler thread drives an Engine (it is not thread-safe itself); adapters are loaded,
replaced and unloaded through the handle from any thread at any time, and a request keeps
the adapter version it held at add() until it finishes. step(): prefill the requests added
since the last step (eagerly, one at a time, into their cache rows), then one decode step of
every running row (input_ids [b, 1], each row at its own position; b = the highest busy row
+ 1, padded up to a graph bucket on a GPU). A failure inside a step fails only the rows it
concerns: a forward that raises is run again one row at a time (eagerly), and a row whose
logits give no token fails alone; each failed row ends with finish reason "error" and its
error. Logprobs (logprobs.py) are computed only for the rows that ask: a token's from the
logits it was picked from, a prompt's from a prefill that keeps every position's logits,
run apart from the prefill of rows that do not ask (theirs keeps the last position only).
Legend: N max_rows, M max_len, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import cuda_graphs
from ..errors import ConfigError, InputError
from ..kernels import compile_ahead
from ..lora.registry import AdapterHold
from ..lora.rows import RowAdapters, using
from . import step_graphs
from .blocks import NULL_BLOCK, BlockPool, digest, seed
from .kv_cache import RowCache, plan_decode, plan_prefill
from .kv_mask import build_masks, mask_rule
from .logprobs import TokenLogprobs, prompt_logprobs, raw_logprobs, token_logprobs
from .mixed_graphs import MixedGraphs, fit_to_bucket
from .paged_cache import PagedCache
from .runner import DecodeRunner, runner_support
from .sampling import (
    RowSampler,
    Sampling,
    SamplingFault,
    TokenConstraint,
    constrain,
    next_tokens,
)
from .served import ServedModel
from .state_snapshots import StateSnapshots, boundary, snapshot_rows
from .support import engine_support

__all__ = ["Engine", "Request", "Sampling", "TokenEvent", "TokenLogprobs"]

log = logging.getLogger("moelora.engine")


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    adapter: str | None  # None = the base model
    sampling: Sampling = Sampling()  # noqa: RUF009 - frozen: one shared default is safe
    # the request's own (stateful) constraint on its tokens: structured output
    constraint: TokenConstraint | None = field(default=None, compare=False)


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int  # -1 when a request ends without a token (cancelled, error)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error" | None
    error: Exception | None = None  # why the request failed (finish_reason "error")
    logprobs: TokenLogprobs | None = None  # the token's, when its sampling asks
    # the request's first event: its prompt's (None first, then one per token), when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(eq=False)  # identity: two requests are never the same row
class _Row:
    """A request from add() to its finish: its cache row, adapter hold and tokens so far."""

    request: Request
    row: int
    hold: AdapterHold
    sampler: RowSampler
    generated: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None  # computed at the prefill, sent with the first event
    prefilled: int = 0  # tokens of `fill` in the cache so far (a chunked prefill's progress)
    seq: int = 0  # order of arrival: the newest row is preempted first
    blocks: list[int] = field(default_factory=list)  # the paged cache's blocks it holds
    digests: list[bytes] = field(default_factory=list)  # of its full blocks' contents so far
    registered: int = 0  # leading blocks in the prefix cache
    matched: bool = False  # its fill looked up in the prefix cache (once per prefill)
    resume: bool = False  # preempted after its first token: its tokens are recomputed

    @property
    def position(self) -> int:
        """Where the last generated token goes when it is fed back."""
        return len(self.request.prompt_ids) + len(self.generated) - 1

    @property
    def fill(self) -> tuple[int, ...]:
        """The tokens a prefill puts in the cache before the row decodes: its prompt, or,
        resuming after a preemption, its prompt and every generated token but the last."""
        if not self.resume:
            return self.request.prompt_ids
        return self.request.prompt_ids + tuple(self.generated[:-1])


def build_runner(handle: ServedModel) -> tuple[DecodeRunner | None, list[str]]:
    """(moelora's decode runner over the handle's model, []), or (None, why it cannot run
    it): a model it does not know (runner_support), or LoRA served on a module it would
    not apply (its rows would lose it)."""
    reasons = runner_support(handle.model)
    if reasons:
        return None, reasons
    runner = DecodeRunner(handle.model, handle.layers, handle.module_banks)
    missing = sorted(set(handle.module_banks.shapes) - runner.paths)
    if missing:
        more = "..." if len(missing) > 3 else ""
        return None, [f"LoRA served on {missing[:3]}{more}, which the runner does not apply"]
    return runner, []


class Engine:
    """Decode engine over a served model (moelora.hf.attach's handle)."""

    def __init__(
        self,
        handle: ServedModel,
        *,
        max_rows: int = 64,
        max_len: int | None = None,
        enforce_eager: bool | None = None,
        runner: bool | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        """runner: decode steps and prefills on moelora's runner (runner.py) rather than the
        model's own forward; None: on a GPU where the runner knows the model (True refuses
        one it does not, naming why). max_num_batched_tokens (vLLM's name): prompt tokens
        one step prefills at most (default PREFILL_TOKENS); on the runner, prompts longer
        than what is left of it are prefilled in chunks over several steps beside the
        running rows' decodes (each chunk reads the ones before it from the cache), so a
        long prompt delays the running rows by one chunk a step.
        long_prefill_token_threshold (vLLM's name; 0: off): on the runner, one prompt's chunk
        is at most this many tokens a step, whatever the budget leaves, so a long prompt
        arriving under load lengthens the running rows' steps by at most that many tokens'
        work (other prompts may fill the rest of the budget in the same step).

        On the runner the KV cache is paged (vLLM's): num_blocks blocks of block_size
        positions (default: max_rows rows of max_len, and the null block), a request holds
        the blocks of its tokens so far, so rows are bounded by tokens held, not by
        max_rows x max_len. When a running row needs a block and none is free, the newest
        row is preempted and later recomputed (its tokens so far prefilled again): it goes on
        with exactly the tokens it would have produced. enable_prefix_caching: a prompt
        whose leading full blocks another request of the same adapter version computed
        reads them instead (blocks.py)."""
        model = handle.model
        self.handle, self.model = handle, model
        self.device = handle.device
        self.runner = self._runner(runner)
        reasons = engine_support(model, runner=self.runner is not None)
        if reasons:
            fix = "use handle.generate (it falls back to model.generate) for this model"
            if not runner and not build_runner(handle)[1]:  # (the runner would run it)
                fix = (
                    "pass runner=True (`moelora serve --decode-runner on`): moelora's runner "
                    "decodes it; or " + fix
                )
            raise ConfigError(
                "model", type(model).__name__, "a model the engine supports: " + "; ".join(reasons),
                fix,
            )  # fmt: skip
        config = model.config
        self.max_len = int(max_len or config.max_position_embeddings)
        self.max_rows = int(max_rows)
        if self.max_rows < 1 or self.max_len < 2:
            raise ConfigError(
                "max_rows / max_len", (max_rows, max_len), "max_rows >= 1, max_len >= 2"
            )
        self.dtype = model.get_input_embeddings().weight.dtype
        self._vocab = model.get_input_embeddings().weight.shape[0]
        self._rule = mask_rule(config)
        self._eos = _eos_ids(model)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pool: BlockPool | None = None
        self.snapshots: StateSnapshots | None = None  # linear-attention prefix states
        self.preemptions = 0
        self.step_tokens = 0  # tokens the last step() forwarded (prompt and decode; a retry again)
        if self.runner is not None:
            self._paged(block_size, num_blocks, enable_prefix_caching)
        else:  # one spare row past max_rows: what padding rows of a graph bucket write
            self.cache = RowCache(config.num_hidden_layers, self.max_rows + 1, self.max_len)
        self._static_buffers()
        self._base = handle.hold([None])[0]  # the banks' snapshot for rows without adapter
        self._rows: dict[str, _Row] = {}  # request id -> row, running or waiting for prefill
        self._waiting: list[_Row] = []
        self._prefilling: list[_Row] = []  # prompts part-way through a chunked prefill
        self._cancelled: list[str] = []
        self._suspended: dict[str, _Row] = {}  # request id -> row out of the engine (suspend)
        self.suspensions = 0
        budget = PREFILL_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens
        if int(budget) < 1:
            raise ConfigError("max_num_batched_tokens", max_num_batched_tokens, ">= 1",
                              "pass None (16384) or a positive number of prompt tokens")  # fmt: skip
        self.max_num_batched_tokens = int(budget)
        if int(long_prefill_token_threshold) < 0:
            raise ConfigError("long_prefill_token_threshold", long_prefill_token_threshold,
                              ">= 0 (0: off)", "pass 0, or the most tokens of one prompt a "
                              "step prefills")  # fmt: skip
        self.long_prefill_token_threshold = int(long_prefill_token_threshold)
        self._arrivals = 0
        use_graphs = self.device.type == "cuda" if enforce_eager is None else not enforce_eager
        self.graphs = (
            step_graphs.StepGraphs(self.max_rows, self._graph_step) if use_graphs else None
        )
        # the steps with prompt chunks, graphed per bucket of tokens (mixed_graphs.py)
        self.mixed = (  # (linear attention's prompts need their lengths on the host)
            MixedGraphs(self, self.max_num_batched_tokens)
            if use_graphs and self.runner is not None and not self.runner.linear
            else None
        )
        self._allocate()

    def _runner(self, wanted: bool | None) -> DecodeRunner | None:
        use = self.device.type == "cuda" if wanted is None else wanted
        runner, reasons = build_runner(self.handle) if use else (None, [])
        if wanted and reasons:
            raise ConfigError("runner", True, "a model the decode runner knows: " + "; ".join(
                reasons), "pass runner=None (or False): transformers' forward decodes it")  # fmt: skip
        return runner

    def _paged(self, block_size: int, num_blocks: int | None, prefix_caching: bool) -> None:
        """The runner's paged cache, its block pool and the block table [max_rows + 1, MB]
        (the last row all null blocks: what padding rows of a graph bucket write)."""
        if int(block_size) < 1:
            raise ConfigError("block_size", block_size, ">= 1 positions per block",
                              "pass 16 (vLLM's default)")  # fmt: skip
        size = int(block_size)
        per_row = -(-self.max_len // size)
        count = self.max_rows * per_row + 1 if num_blocks is None else int(num_blocks)
        if count - 1 < per_row:
            raise ConfigError(
                "num_blocks", num_blocks,
                f">= {per_row + 1}: one request of max_len {self.max_len} positions fills "
                f"{per_row} blocks of {size}, and block 0 is the null block",
                "give the cache more blocks (--gpu-memory-utilization) or lower max_len",
            )  # fmt: skip
        self.pool = BlockPool(count, size, bool(prefix_caching))
        kept = snapshot_rows(self.max_rows, bool(prefix_caching) and bool(self.runner.linear))
        try:  # (the linear-attention layers' states: one per block-table row, then snapshots)
            self.cache = PagedCache(self.model, count, size, self.device, self.dtype,
                                    rows=self.max_rows + 1 + kept)  # fmt: skip
        except torch.OutOfMemoryError:
            raise ConfigError(
                "num_blocks x block_size", f"{count} x {size}",
                "a KV cache that fits in the device's free memory",
                "pass fewer blocks (num_blocks, --gpu-memory-utilization) or a smaller max_len",
            ) from None  # fmt: skip
        if kept:
            self.snapshots = StateSnapshots(self.cache.states, self.max_rows + 1, kept)
        self._table = torch.zeros(self.max_rows + 1, per_row, dtype=torch.int32,
                                  device=self.device)  # fmt: skip
        self._table_writes: list[tuple[int, int, int]] = []  # (row, index, block) to copy

    def _allocate(self) -> None:
        """A one-token prefill into row 0 allocates every layer's cache (shapes as the model
        gives them; the paged cache is allocated already); a cache larger than the device's
        memory is refused, named."""
        if self.pool is not None:
            return
        try:
            self._prefill_tokens([0], row=0, hold=self._base)
        except torch.OutOfMemoryError:
            self._base.release()
            raise ConfigError(
                "max_rows x max_len", f"{self.max_rows} x {self.max_len}",
                "a KV cache that fits in the device's free memory",
                "pass a smaller max_len (default: the model's max positions) or max_rows",
            ) from None  # fmt: skip

    def _static_buffers(self) -> None:
        """What a decode step reads, kept as the same tensors for CUDA graphs: token ids [N, 1],
        positions [N, 1], the cache row each batch row writes [N, 1] (its own, or the spare
        row N for padding), row slots [N] and the token-slot buffer [N]."""
        n, dev = self.max_rows, self.device
        self._ids = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self._positions = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self._write_rows = torch.full((n, 1), n, dtype=torch.long, device=dev)
        self._slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self._token_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)

    # ---- the contract ---------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._rows or self._cancelled)

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def vocab_size(self) -> int:
        """V: the width of the logits (token ids are below it)."""
        return self._vocab

    def check(self, request: Request) -> None:
        """InputError when the request can never run here: its sampling, prompt and length.
        Its adapter is checked once, when add() holds it (an unload may happen before)."""
        request.sampling.check()
        prompt = request.prompt_ids
        if not prompt:
            raise InputError(
                f"request {request.request_id!r} prompt_ids", "empty", "at least one token id"
            )
        if min(prompt) < 0 or max(prompt) >= self._vocab:
            raise InputError(
                f"request {request.request_id!r} prompt_ids",
                f"ids in [{min(prompt)}, {max(prompt)}]", f"token ids in [0, {self._vocab})",
            )  # fmt: skip
        total = len(prompt) + request.sampling.max_new_tokens
        if total > self.max_len:
            raise InputError(
                f"request {request.request_id!r} prompt + max_new_tokens", total,
                f"at most the engine's max_len = {self.max_len}: shorten the prompt or "
                "lower max_new_tokens",
            )  # fmt: skip

    def admissible(self, request: Request) -> str | None:
        """None when add(request) would run at the next step; else why it must wait."""
        if self._row_free() is not None:
            return self._row_free()
        version = self.handle.version(request.adapter)  # the one add() would hold
        key = None if version is None else version.key
        held = {r.hold.key for r in self._rows.values()} - {None}
        taken = held | self.handle.pinned_keys  # a pinned adapter's slot is never free
        if key is not None and key not in taken and len(taken) >= self.handle.num_slots:
            return (f"every adapter slot ({self.handle.num_slots}) is held by running requests "
                    f"or pinned ({len(taken - held)} pinned)")  # fmt: skip
        if self.pool is not None:
            need = self.pool.blocks_for(len(request.prompt_ids) + 1)
            if need > self.pool.available:
                return (f"the KV cache has {self.pool.available} free blocks of "
                        f"{self.pool.block_size} positions; the prompt needs {need}")  # fmt: skip
        return None

    def _free_row_index(self) -> int:
        """The lowest cache row no running request holds (_row_free() must be None)."""
        busy = {r.row for r in self._rows.values()}
        return next(i for i in range(self.max_rows) if i not in busy)

    def _row_free(self) -> str | None:
        if len(self._rows) >= self.max_rows:
            return f"no free row ({self.max_rows} requests running)"
        return None

    def add(self, request: Request, hold: AdapterHold | None = None) -> None:
        """Join at the next step (check() and admissible() must pass). hold: the request's
        adapter already held (handle.hold for a batch of requests, taken at once); the
        engine releases it at the finish. Default: held here, which is where an adapter
        name not loaded (any more) is refused."""
        self.check(request)
        if request.request_id in self._rows:
            raise InputError("request_id", repr(request.request_id), "an id no running request has")
        # a given hold already has its slot (the version it holds, whatever is current now)
        reason = self.admissible(request) if hold is None else self._row_free()
        if reason is not None:
            raise InputError(
                f"request {request.request_id!r}", reason, "add() once admissible() returns None"
            )
        row = self._free_row_index()
        if hold is None:
            hold = self.handle.hold([request.adapter])[0]  # the version current now, to the end
        sampler = RowSampler.make(
            request.sampling, self._eos, self.device, request.prompt_ids, self._vocab,
            request.constraint,
        )  # fmt: skip
        self._arrivals += 1
        state = _Row(request, row, hold, sampler, seq=self._arrivals)
        self._rows[request.request_id] = state
        self._waiting.append(state)

    def cancel(self, request_id: str) -> None:
        """Free the request's row at the next step (a finished or unknown id: nothing)."""
        if request_id in self._rows and request_id not in self._cancelled:
            self._cancelled.append(request_id)

    # ---- suspension: a running request out of its row and slot, later resumed -------------

    def suspend(self, request_id: str) -> None:
        """Take a running request out of the engine without ending it, so that its adapter's
        slot can go to another adapter (the serving scheduler's bound on a request's wait):
        its blocks go back (kept as cached blocks, so that its own recompute can hit them),
        its row and its adapter hold are released. Its tokens, sampler and logprobs stay
        with it; resume() brings it back, recomputing its tokens so far as after a
        preemption, so its output is what it would have been. Paged engines only."""
        if self.pool is None:
            raise InputError("suspend", "an engine without a paged cache",
                             "the decode runner's paged cache (runner=True)")  # fmt: skip
        if request_id not in self._rows or request_id in self._cancelled:
            raise InputError("suspend request_id", repr(request_id), "a running request's id")
        row = self._rows.pop(request_id)
        self._waiting = [r for r in self._waiting if r is not row]
        self._prefilling = [r for r in self._prefilling if r is not row]
        self._drop_blocks(row)
        row.hold.release()
        self._suspended[request_id] = row
        self.suspensions += 1
        log.info("suspended request %s (%d tokens so far)", request_id, len(row.generated))

    @property
    def suspended(self) -> frozenset[str]:
        """The ids of the suspended requests (waiting for resume() or drop_suspended())."""
        return frozenset(self._suspended)

    def resumable(self, request_id: str) -> str | None:
        """None when resume(request_id) would run it at the next step; else why it waits
        (as admissible() for a new request of its adapter)."""
        row = self._suspended[request_id]
        return self.admissible(dataclasses.replace(row.request, prompt_ids=row.fill))

    def resume(self, request_id: str) -> None:
        """Bring a suspended request back (resumable() must pass): a row, a hold on the
        adapter version it ran with, its tokens so far recomputed at the next step. Refused
        (InputError, the request then dropped) when its adapter was replaced or unloaded
        meanwhile: its tokens so far came from a version no longer served."""
        row = self._suspended[request_id]
        reason = self.resumable(request_id)
        if reason is not None:
            raise InputError(f"request {request_id!r}", reason, "resume() once resumable() is None")
        name, held = row.request.adapter, row.hold.key
        try:
            hold = self.handle.hold([name])[0]  # the version current now...
        except InputError:
            hold = None  # unloaded meanwhile
        if hold is None or hold.key != held:  # ...must be the one its tokens came from
            if hold is not None:
                hold.release()
            del self._suspended[request_id]
            raise InputError(
                f"request {request_id!r} adapter {name!r}",
                f"{'unloaded' if hold is None else 'replaced'} while the request was "
                "suspended for another adapter's slot",
                "the version it started with: send the request again",
            )  # fmt: skip
        row.row, row.hold = self._free_row_index(), hold
        del self._suspended[request_id]
        self._rows[request_id] = row
        if row.resume:  # recomputed as after a preemption, then decoding on
            self._prefilling.append(row)
        else:  # no token yet: prefilled as a new request (prompt logprobs and all)
            self._waiting.append(row)

    def drop_suspended(self, request_id: str) -> None:
        """Forget a suspended request (cancelled, or the server stopping); unknown: nothing."""
        self._suspended.pop(request_id, None)

    def step(self) -> list[TokenEvent]:
        """Prefill the requests added since the last step, then decode every running row.
        A forward that raises is retried row by row: only the rows that fail alone end, with
        finish reason "error" (see the module doc)."""
        self.step_tokens = 0
        events = [self._finish(rid, -1, "cancelled") for rid in self._cancelled]
        self._cancelled.clear()
        waiting, self._waiting = self._waiting, []
        decode = [r for r in self._rows.values() if r not in waiting and r not in self._prefilling]
        if self.runner is not None:
            return events + self._runner_step(waiting, decode)
        for group in _prefill_groups(waiting, self.max_num_batched_tokens, varlen=False):
            events += self._isolated(group, self._prefill, lambda r: self._prefill([r]))
        if decode:
            events += self._isolated(decode, self._decode, self._decode_alone)
        return events

    def _isolated(self, rows: list[_Row], forward, alone, accept=None) -> list[TokenEvent]:
        """The events of `accept(rows, forward(rows))` (accept: _accept by default); if it
        raises, of `alone(row)` for each row, a row whose own forward raises failing with
        its error."""
        accept = accept or self._accept
        try:
            return accept(rows, forward(rows))
        except Exception as err:
            if len(rows) == 1:
                log.warning("request %s failed: %r", rows[0].request.request_id, err)
                return [self._fail(rows[0], err)]
            log.warning("a step of %d rows failed (%r); running them one by one", len(rows), err)
        events = []
        for r in rows:
            try:
                events += accept([r], alone(r))
            except Exception as err:
                log.warning("request %s failed: %r", r.request.request_id, err)
                events.append(self._fail(r, err))
        return events

    def warmup(self) -> step_graphs.CaptureReport | None:
        """Capture every decode bucket now, and on the runner every token bucket of the
        steps with prompt chunks (None without graphs). Only while nothing runs: the
        captures write padding into cache rows."""
        if self.graphs is None:
            return None
        if self._rows:
            raise InputError(
                "warmup()", f"{len(self._rows)} requests running", "no request running"
            )
        self._compile_ahead(self.handle.lora_modules)
        report = self.graphs.capture_all(self._pad_only, self.handle.lora_modules)
        if self.mixed is None:
            return report
        prompts = self.mixed.capture_all(self.handle.lora_modules)
        return step_graphs.CaptureReport(report.buckets, report.seconds + prompts.seconds,
                                         prompts.buckets)  # fmt: skip

    def _compile_ahead(self, modules: frozenset[str]) -> int:
        """Compile the Triton variants of every step warmup() captures, in parallel, before
        the captures (which then compile nothing; a cold capture of the 48-layer Qwen3
        runner was two thirds compile): each step run once from padding with its kernels
        recorded, not launched (the runner's torch ops index only with their inputs; what
        they write into the null block and the spare row's states is put back), then
        kernels/compile_ahead.compile_all. Returns the launches recorded (0: left out: not
        on the runner, on a CPU, or with MOELORA_COMPILE_AHEAD=0). A failure costs only the
        time: the captures compile as they go."""
        if self.runner is None or not compile_ahead.wanted(self.device):
            return 0
        start, launches = time.perf_counter(), compile_ahead.Distinct()
        # what padding steps write, kept: the pass's torch ops write unlaunched kernels'
        # outputs there (DeepSeek's latent, Qwen3.5's conv window)
        padding = [t for layer in self.cache.layers if layer
                   for t in (layer.keys[NULL_BLOCK], layer.values[NULL_BLOCK])]  # fmt: skip
        padding += [t[self.max_rows] for s in self.cache.states.values()
                    for t in (s.conv, s.recurrent)]  # fmt: skip
        kept = [t.clone() for t in padding]
        try:
            try:
                with torch.no_grad(), compile_ahead.recording(launches.add):
                    for bucket in self.graphs.buckets:
                        self._pad_only(bucket)
                        self._graph_step(bucket, modules)
                    for bucket in self.mixed.buckets if self.mixed is not None else ():
                        self.mixed.prepare(bucket)
                        self.mixed.step(bucket, modules)
            finally:
                for t, was in zip(padding, kept):
                    t.copy_(was)
            compile_ahead.compile_all(launches.launches)
        except Exception as err:  # any failure: the captures compile as they go
            log.warning("compiling the steps' kernels ahead failed (%r); the captures compile "
                        "them one by one", err)  # fmt: skip
            return 0
        log.info("the steps' kernels compiled ahead in %.1f s (%d launches, %d distinct)",
                 time.perf_counter() - start, launches.seen, len(launches.launches))  # fmt: skip
        return launches.seen

    def warm_prompts(self, adapters: Sequence[str | None] = (None,)) -> PromptWarmup | None:
        """Run synthetic prompts through the runner's steps before any request, so that the
        kernels of prompt steps are compiled (Triton compiles a variant at its first launch:
        a tile per token-count bucket, an integer's divisibility by 16) and a first
        request of a new length does not stall every running row for the compile. Prompts
        of WARM_LENGTHS tokens (capped by max_num_batched_tokens, max_len and the cache),
        each joining while the one before decodes (mixed steps), 2 tokens each, for each of
        `adapters`; then the prefix cache's counters, the step's token count and the
        preemptions are set back (their blocks stay as cached blocks, evictable), also when
        it raises (its rows ended first). None off the runner, or where the cache has no
        room for one. Only while nothing runs."""
        if self.runner is None:
            return None
        if self._rows:
            raise InputError(
                "warm_prompts()", f"{len(self._rows)} requests running", "no request running"
            )
        start = time.perf_counter()
        limit = min(self.max_num_batched_tokens, self.max_len - 3,
                    (self.pool.capacity // 2) * self.pool.block_size - 3)  # fmt: skip
        lengths = sorted({min(n, limit) for n in WARM_LENGTHS if limit >= 1})
        if not lengths:  # a cache too small to hold any warm-up prompt beside another
            return None
        stats, preemptions = dataclasses.replace(self.pool.stats), self.preemptions
        gen = torch.Generator().manual_seed(0)
        sampling = Sampling(max_new_tokens=2, ignore_eos=True)
        count = 0
        try:
            for adapter in adapters:
                for n in lengths:
                    ids = torch.randint(1, self._vocab, (n,), generator=gen).tolist()
                    while self._row_free() is not None:  # max_rows 1: the last one ends first
                        self.step()
                    self.add(Request(f"moelora-warmup-{count}", tuple(ids), adapter, sampling))
                    count += 1
                    while self._prefilling or self._waiting:  # its prompt in, the last ending
                        self.step()
                while self.has_work:
                    self.step()
        finally:  # also when a step or add() raised: no warm-up row outlives it
            self.clear()
            self.pool.stats, self.preemptions, self.step_tokens = stats, preemptions, 0
        return PromptWarmup(count, tuple(lengths), time.perf_counter() - start)

    def clear(self) -> None:
        """End every request now, without events, releasing their adapters."""
        for rid in list(self._rows):
            self._finish(rid, -1, "cancelled")
        self._cancelled.clear()

    def close(self) -> None:
        """clear(), and release the engine's own hold on the banks; the engine is done."""
        self.clear()
        self._base.release()

    # ---- forwards ---------------------------------------------------------------------------

    def _forward(
        self, ids: Tensor, positions: Tensor, masks, rows: RowAdapters, every: bool = False
    ) -> Tensor:
        """logits [b, V] of the last token of each row; every: of each position [b, S, V]."""
        kwargs = {self._cache_kw: self.cache}
        with torch.no_grad(), using(rows):
            out = self.model(
                input_ids=ids, position_ids=positions, attention_mask=masks, use_cache=True,
                logits_to_keep=0 if every else 1, **kwargs,
            )  # fmt: skip
        return out.logits if every else out.logits[:, -1]

    def _runner_step(self, waiting: list[_Row], decode: list[_Row]) -> list[TokenEvent]:
        """One step on the runner (vLLM V1's unified batch): the running rows' blocks first;
        rows asking for prompt logprobs prefilled whole, in groups of their own; then one
        forward of every running row's next token and the waiting prompts' next chunks,
        oldest row first, up to max_num_batched_tokens tokens in all (each chunk's blocks
        taken first; a prompt starting with cached blocks begins after them). Without
        chunks the running rows decode alone (a graph replay on a GPU). A row whose chunk
        ends its prompt gets its first token (a resumed row goes back to decoding)."""
        decode = self._grow(decode)
        asking = [r for r in waiting if r.request.sampling.prompt_logprobs is not None]
        events = self._whole_prompts(asking)
        self._prefilling += [r for r in waiting if r not in asking]
        chunks = self._chunks(self.max_num_batched_tokens - len(decode))
        decode = [r for r in decode if r not in self._prefilling]  # preempted by a chunk
        if chunks and self.mixed is not None:  # a graphed step: no bucket mostly padding
            total = len(decode) + sum(end - a for _, a, end in chunks)
            fitted = fit_to_bucket(self.mixed.buckets, total, len(decode))
            chunks = _cut(chunks, total - fitted)
        self._write_table()
        if not chunks:
            if decode:
                events += self._isolated(decode, self._decode, self._decode_alone)
                self._register([r for r in decode if r.request.request_id in self._rows])
            return events
        chunks = [(r, r.position, r.position + 1) for r in decode] + chunks
        rows = [r for r, _, _ in chunks]

        def tokens(r: _Row, a: int, b: int) -> list[int]:
            return [r.generated[-1]] if r in decode else list(r.fill[a:b])

        def forward(rows: list[_Row]) -> Tensor:
            mine = [c for c in chunks if c[0] in rows]  # in the order of `rows`
            return self._prefill_rows([tokens(*c) for c in mine], [r.row for r, _, _ in mine],
                                      [r.hold for r, _, _ in mine],
                                      starts=[a for _, a, _ in mine],
                                      graphed=len(mine) == len(chunks))  # fmt: skip

        done = [r for r, _, end in chunks if r not in decode and end == len(r.fill)]
        for r, _, end in chunks:
            if r not in decode:
                r.prefilled = end
        self._prefilling = [r for r in self._prefilling if r not in done]
        sampled = set(decode) | {r for r in done if not r.resume}

        def accept(rows: list[_Row], logits: Tensor) -> list[TokenEvent]:
            keep = [i for i, r in enumerate(rows) if r in sampled]
            return self._accept([rows[i] for i in keep], logits[keep])

        if self.runner.linear:  # a failed step may have advanced the rows' states
            ends = {r.request.request_id: end for r, _, end in chunks}

            def alone(r: _Row) -> Tensor:
                return self._recompute(r, ends[r.request.request_id])
        else:

            def alone(r: _Row) -> Tensor:
                return forward([r])

        events += self._isolated(rows, forward, alone, accept)
        live = [r for r in rows if r.request.request_id in self._rows]
        self._take_snapshots([(r, end) for r, _, end in chunks if r in live and r not in decode])
        self._register([r for r in live if r in decode])
        self._register([r for r in live if r not in decode], filled=True)
        for r in done:
            r.resume = False  # back to decoding (its last token is fed next step)
        return events

    def _whole_prompts(self, asking: list[_Row]) -> list[TokenEvent]:
        """Rows asking for prompt logprobs: every position's logits, no cached block read,
        once the blocks of the whole prompt are free (else they wait for the next step)."""
        ready = []
        for r in asking:
            if self._give(r, self.pool.blocks_for(len(r.fill))):
                ready.append(r)
            else:
                self._waiting.append(r)
        self._write_table()
        events = []
        for group in _prefill_groups(ready, self.max_num_batched_tokens, varlen=True):
            events += self._isolated(group, self._prefill, lambda r: self._prefill([r]))
        self._register([r for r in ready if r.request.request_id in self._rows], filled=True)
        return events

    def _chunks(self, budget: int) -> list[tuple[_Row, int, int]]:
        """The prefilling rows' next chunks (row, first, end) in `fill`, oldest row first, up
        to `budget` tokens (and each at most long_prefill_token_threshold when set), each
        one's blocks taken (preempting rows newer than it); a row whose blocks the rows
        before it hold waits, and the rows after it too."""
        cap = self.long_prefill_token_threshold or budget
        self._prefilling.sort(key=lambda r: r.seq)
        left, chunks = budget, []
        for r in list(self._prefilling):
            if left <= 0:
                break
            if r not in self._prefilling:  # preempted by an older row's chunk
                continue
            tokens = r.fill
            if not r.matched:
                self._match(r, tokens)
            end = min(len(tokens), r.prefilled + min(left, cap))
            if self.snapshots is not None:  # a chunk ends where the row's snapshot is taken
                at = boundary(len(tokens), self.pool.block_size)
                end = at if r.prefilled < at < end else end
            if not self._give(r, self.pool.blocks_for(end) - len(r.blocks)):
                break
            chunks.append((r, r.prefilled, end))
            left -= end - r.prefilled
        return [c for c in chunks if c[0] in self._prefilling]

    # ---- the paged cache's blocks ----------------------------------------------------------

    def _grow(self, decode: list[_Row]) -> list[_Row]:
        """A block for each decoding row whose next position starts one, oldest row first;
        when none is free, the newest row holding blocks is preempted (the row itself when
        it is the newest). The rows still decoding."""
        for r in sorted(decode, key=lambda r: r.seq):
            if r in self._prefilling:  # preempted for an older row
                continue
            need = self.pool.blocks_for(r.position + 1) - len(r.blocks)
            if need > 0 and not self._give(r, need):
                self._preempt(r)
        return [r for r in decode if r not in self._prefilling]

    def _give(self, row: _Row, n: int) -> bool:
        """n more blocks to `row`, preempting rows newer than it while too few are free;
        False (nothing taken) when the rows before it hold the rest."""
        if n <= 0:
            return True
        while self.pool.available < n:
            newer = [r for r in self._rows.values() if r.seq > row.seq and r.blocks]
            if not newer:
                return False
            self._preempt(max(newer, key=lambda r: r.seq))
        blocks = self.pool.allocate(n)
        at = len(row.blocks)
        self._table_writes += [(row.row, at + i, b) for i, b in enumerate(blocks)]
        row.blocks += blocks
        return True

    def _preempt(self, row: _Row) -> None:
        """Free a row's blocks (vLLM's preemption by recompute): it is prefilled again, its
        prompt and the tokens it generated, and decodes on from where it was."""
        log.info("preempting request %s (%d blocks)", row.request.request_id, len(row.blocks))
        self._drop_blocks(row)
        if row not in self._prefilling:
            self._prefilling.append(row)
        self.preemptions += 1

    def _drop_blocks(self, row: _Row) -> None:
        """Give back a row's blocks (kept as cached blocks where registered): it is prefilled
        again from its first token, a row with tokens as a resumed one (preemption and
        suspension both recompute)."""
        self.pool.release(row.blocks)
        row.blocks, row.registered, row.prefilled, row.matched = [], 0, 0, False
        row.resume = bool(row.generated)

    def _write_table(self) -> None:
        """The blocks handed out since the last forward, into the device's block table."""
        if self._table_writes:  # one write per entry, the last (index_put keeps any one)
            last = {(row, i): block for row, i, block in self._table_writes}
            where = torch.tensor([(*k, b) for k, b in last.items()], dtype=torch.long)
            where = where.to(self.device)
            self._table[where[:, 0], where[:, 1]] = where[:, 2].to(torch.int32)
            self._table_writes.clear()

    def _digests(self, row: _Row, tokens, n: int) -> list[bytes]:
        """The digests of row's first n full blocks of `tokens` (its prompt and outputs)."""
        size = self.pool.block_size
        while len(row.digests) < n:
            i = len(row.digests)
            parent = row.digests[-1] if row.digests else seed(row.hold.key)
            row.digests.append(digest(parent, tokens[i * size : (i + 1) * size]))
        return row.digests[:n]

    def _match(self, row: _Row, tokens) -> None:
        """A row starting its prefill takes the cached blocks of its leading full blocks
        (at most up to its last token, which is always computed); on a model with
        linear-attention layers, up to the last of them with a state snapshot, copied into
        the row (state_snapshots.py)."""
        full = (len(tokens) - 1) // self.pool.block_size
        digests = self._digests(row, tokens, full) if self.pool.prefix_caching else []
        hit = self.pool.match(digests)
        if self.snapshots is not None and hit:
            keep = self.snapshots.longest(digests[: len(hit)])
            self.pool.release(hit[keep:])
            hit = hit[:keep]
            if keep:
                self.snapshots.restore(digests[keep - 1], row.row)
        self._table_writes += [(row.row, i, b) for i, b in enumerate(hit)]
        row.blocks, row.registered, row.matched = list(hit), len(hit), True
        row.prefilled = len(hit) * self.pool.block_size
        self.pool.count(len(tokens), row.prefilled)

    def _take_snapshots(self, ends: list[tuple[_Row, int]]) -> None:
        """Snapshots of the linear-attention states of the rows whose chunk (row, end) just
        ended at their snapshot boundary (_chunks cut it there)."""
        if self.snapshots is None:
            return
        size = self.pool.block_size
        for r, end in ends:
            at = boundary(len(r.fill), size)
            if at and end == at:
                self.snapshots.save(self._digests(r, r.fill, at // size)[-1], r.row)

    def _register(self, rows: list[_Row], filled: bool = False) -> None:
        """The blocks the last forward filled, into the prefix cache: after a prefill
        (filled: each row's `prefilled` tokens held) or a decode (positions up to each
        row's last fed token)."""
        if not self.pool.prefix_caching:
            return
        size = self.pool.block_size
        for r in rows:
            held = r.prefilled if filled else r.position  # the decode appended one since
            full = min(held // size, len(r.blocks))
            if full <= r.registered:
                continue
            tokens = r.fill if filled else r.request.prompt_ids + tuple(r.generated)
            for i, d in enumerate(self._digests(r, tokens, full)[r.registered :], r.registered):
                self.pool.register(r.blocks[i], d)
            r.registered = full

    def _prefill(self, group: list[_Row]) -> Tensor:
        """Prompts into their cache rows in one forward (of one length on transformers'
        forward; of any lengths, packed, on the runner); logits [n, V] of each prompt's
        last token. A group that asks for prompt logprobs (_prefill_groups groups them
        apart) keeps every position's logits and stores each row's."""
        prompts = [list(r.request.prompt_ids) for r in group]
        rows, holds = [r.row for r in group], [r.hold for r in group]
        if group[0].request.sampling.prompt_logprobs is None:
            return self._prefill_rows(prompts, rows, holds)
        per_row = self._prefill_rows(prompts, rows, holds, every=True)
        for r, row_logits in zip(group, per_row):
            top = r.request.sampling.prompt_logprobs
            r.prompt_logprobs = prompt_logprobs(row_logits, r.request.prompt_ids, top)
        return torch.stack([row_logits[-1] for row_logits in per_row])

    def _prefill_tokens(self, prompt: list[int], row: int, hold: AdapterHold) -> Tensor:
        """One request's prompt into its cache row; logits [1, V] of its last token."""
        return self._prefill_rows([prompt], [row], [hold])

    def _prefill_rows(
        self,
        prompts: list[list[int]],
        rows: list[int],
        holds,
        every: bool = False,
        starts=None,
        graphed: bool = False,
    ):
        """Logits [n, V] of each prompt's last token; with `every`, a list of each prompt's
        [S_i, V]; starts: each prompt's first position (a chunk; the runner only); graphed:
        replayed from a graph of its bucket of tokens where one holds it (the runner only)."""
        self.step_tokens += sum(len(p) for p in prompts)
        if self.runner is not None:
            return self._prefill_runner(prompts, rows, holds, every, starts, graphed)
        plan = plan_prefill(rows, len(prompts[0]), self.device)
        self.cache.plan = plan
        slots = torch.tensor([h.slot for h in holds], dtype=torch.int32, device=self.device)
        adapters = RowAdapters(
            row_slots=slots, snapshot=holds[0].snapshot, expert_lora=any(h.experts for h in holds),
            lora_modules=frozenset().union(*(h.modules for h in holds)),
            token_buffer=torch.empty(plan.positions.numel(), dtype=torch.int32, device=self.device),
        )  # fmt: skip
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        masks = build_masks(self._rule, plan.positions, plan.kv_len, self.dtype)
        if every:
            return list(self._forward(ids, plan.positions, masks, adapters, every=True))
        return self._forward(ids, plan.positions, masks, adapters)

    def _prefill_runner(self, prompts, rows: list[int], holds, every: bool, starts=None,
                        graphed: bool = False):  # fmt: skip
        """The prompts packed into one varlen forward of the runner (no padding, no mask);
        starts: each one's first position (chunks after the ones in the cache; default 0);
        graphed: a graph replay (mixed_graphs.py) when one holds the step's tokens."""
        lengths = [len(p) for p in prompts]
        starts = starts or [0] * len(prompts)
        if graphed and not every and self.mixed is not None and self.mixed.fits(sum(lengths)):
            modules = self._graph_modules(holds)
            logits = self.mixed.run(prompts, starts, rows, [h.slot for h in holds], modules)
            if logits is not None:
                return logits
        host = torch.tensor(
            [[t for p in prompts for t in p],
             [a + i for a, n in zip(starts, lengths) for i in range(n)],
             [r for r, n in zip(rows, lengths) for _ in range(n)],
             [h.slot for h, n in zip(holds, lengths) for _ in range(n)]]
        )  # fmt: skip
        host = host.to(self.device)
        slots = host[3].to(torch.int32)
        adapters = RowAdapters(
            row_slots=slots, snapshot=holds[0].snapshot, expert_lora=any(h.experts for h in holds),
            lora_modules=frozenset().union(*(h.modules for h in holds)),
            token_buffer=torch.empty_like(slots),
        )  # fmt: skip
        with torch.no_grad():
            logits = self.runner.prefill(host[0], host[1], host[2], lengths, rows, adapters,
                                         self.cache, self._table, every, pos0=starts)  # fmt: skip
        return list(logits.split(lengths)) if every else logits

    def _decode(self, running: list[_Row], eager: bool = False) -> Tensor:
        """One token of every running row; logits [len(running), V] in their order.
        eager: no graph replay (a retry of one row after a step failed)."""
        self.step_tokens += len(running)
        width = max(r.row for r in running) + 1
        modules = self._graph_modules([r.hold for r in running])
        graphed = self.graphs is not None and not eager
        width = self.graphs.bucket(width) if graphed else width
        if graphed and self.runner is not None and self.runner.linear and not self.graphs.has(
                width, modules):  # fmt: skip
            # a capture's warm-up run would advance the rows' linear-attention states once
            # more than the replay: captured on padding rows (the spare row's state) first
            self._pad_only(width)
            self.graphs.capture(width, modules)
        self._fill(running, width)
        if graphed:
            logits = self.graphs.run(width, modules)
        else:
            kv_len = max(r.position for r in running) + 1
            logits = self._decode_step(width, kv_len, modules)
        return logits[[r.row for r in running]]

    def _graph_modules(self, holds) -> frozenset[str]:
        """The served modules with LoRA a graphed step runs: a Python branch in each module's
        hook, fixed in a graph, so one set for every step while the loaded adapters' set
        stays (rows without factors on a module add exactly 0); rows of a retired version
        add theirs."""
        return self.handle.lora_modules.union(*(h.modules for h in holds))

    def _decode_alone(self, row: _Row) -> Tensor:
        if self.runner is not None and self.runner.linear:
            return self._recompute(row, row.position + 1)
        return self._decode([row], eager=True)

    def _recompute(self, row: _Row, end: int) -> Tensor:
        """Logits [1, V] of the token at position end - 1 of `row`, its first `end` tokens
        (prompt, then generated) prefilled from position 0 in chunks of at most
        max_num_batched_tokens: a row retried alone after a step that failed, on a model with
        linear-attention layers, whose states that step may have advanced (its blocks hold
        every position up to end - 1)."""
        tokens = (tuple(row.request.prompt_ids) + tuple(row.generated))[:end]
        step = self.max_num_batched_tokens
        for start in range(0, end, step):
            chunk = list(tokens[start : start + step])
            logits = self._prefill_rows([chunk], [row.row], [row.hold], starts=[start])
        return logits

    def _fill(self, running: list[_Row], width: int) -> None:
        """The static buffers for rows 0 .. width-1: padding rows (free rows, and rows
        prefilled in this step) feed token 0 at position 0 without adapter and write the
        spare cache row."""
        ids, positions, slots = [0] * width, [0] * width, [-1] * width
        rows = [self.max_rows] * width
        for r in running:  # plain lists, one tensor: no per-row tensor on the host
            ids[r.row], positions[r.row], slots[r.row], rows[r.row] = (
                r.generated[-1], r.position, r.hold.slot, r.row)  # fmt: skip
        host = torch.tensor([ids, positions, slots, rows]).to(self.device, non_blocking=True)
        self._ids[:width, 0].copy_(host[0])
        self._positions[:width, 0].copy_(host[1])
        self._slots[:width].copy_(host[2])
        self._write_rows[:width, 0].copy_(host[3])

    def _pad_only(self, width: int) -> None:
        self._fill([], width)

    def _decode_step(self, width: int, kv_len: int, modules: frozenset[str]) -> Tensor:
        """The decode forward of rows 0 .. width-1 from the static buffers."""
        positions = self._positions[:width]
        rows = RowAdapters(
            row_slots=self._slots[:width], snapshot=self._base.snapshot, expert_lora=True,
            lora_modules=modules, token_buffer=self._token_slots[:width],
        )  # fmt: skip
        if self.runner is not None:
            with torch.no_grad():
                return self.runner.decode(self._ids[:width], positions, self._write_rows[:width],
                                          rows, self.cache, kv_len, self._table)  # fmt: skip
        self.cache.plan = plan_decode(self._write_rows[:width], positions, kv_len)
        masks = build_masks(self._rule, positions, kv_len, self.dtype)
        return self._forward(self._ids[:width], positions, masks, rows)

    def _graph_step(self, width: int, modules: frozenset[str]) -> Tensor:
        with cuda_graphs.inline():  # the whole step is graphed: no per-layer graphs in it
            return self._decode_step(width, self.max_len, modules)

    # ---- tokens -----------------------------------------------------------------------------

    def _accept(self, rows: list[_Row], logits: Tensor) -> list[TokenEvent]:
        """Pick each row's next token; an event per token, rows that stop finish."""
        samplers = [r.sampler for r in rows]
        logits = constrain(logits, samplers)
        asking = [i for i, r in enumerate(rows) if r.request.sampling.logprobs is not None]
        # before the pick: the sampling processors may change the logits in place
        raw = raw_logprobs(logits[asking]) if asking else None
        tokens = next_tokens(logits, samplers, [len(r.generated) for r in rows])
        logprobs: dict[int, TokenLogprobs] = {}
        picked = [i for i in asking if not isinstance(tokens[i], SamplingFault)]
        if picked:
            at = [asking.index(i) for i in picked]
            tops = [rows[i].request.sampling.logprobs for i in picked]
            found = token_logprobs(raw[at], [tokens[i] for i in picked], tops)
            logprobs = dict(zip(picked, found))
        events = []
        for i, (state, token) in enumerate(zip(rows, tokens)):
            if isinstance(token, SamplingFault):
                events.append(self._fail(state, token))
                continue
            state.generated.append(token)
            state.sampler.note(token)
            reason = None
            if token in state.sampler.stop_ids or state.sampler.finished:
                reason = "stop"
            elif len(state.generated) >= state.request.sampling.max_new_tokens:
                reason = "length"
            extra = dict(logprobs=logprobs.get(i), prompt_logprobs=state.prompt_logprobs)
            state.prompt_logprobs = None  # sent once, with the first token
            if reason is None:
                events.append(TokenEvent(state.request.request_id, token, False, None, **extra))
            else:
                events.append(self._finish(state.request.request_id, token, reason, **extra))
        return events

    def _finish(
        self, request_id: str, token: int, reason: str, error: Exception | None = None, **extra
    ) -> TokenEvent:
        state = self._rows.pop(request_id)
        if state in self._waiting:
            self._waiting.remove(state)
        if state in self._prefilling:
            self._prefilling.remove(state)
        if state.blocks:
            self.pool.release(state.blocks)
            state.blocks = []
        state.hold.release()
        return TokenEvent(request_id, token, True, reason, error, **extra)

    def _fail(self, state: _Row, error: Exception) -> TokenEvent:
        """End a row that failed inside a step (finish reason "error")."""
        return self._finish(state.request.request_id, -1, "error", error)


# Tokens of one prefill forward at most: the MoE layers' largest tuned T (and the activation
# memory of a 16k-token forward stays a few hundred MB at Qwen3-30B-A3B's width).
PREFILL_TOKENS = 16384
# Engine.warm_prompts' prompt lengths: both sides of each power of two's tile bucket and of
# Triton's divisible-by-16 specialization, up to the default step budget
WARM_LENGTHS = (1, 5, 16, 33, 64, 127, 256, 513, 1024, 2047, 4096, 8191, PREFILL_TOKENS)


@dataclass(frozen=True)
class PromptWarmup:
    """What Engine.warm_prompts ran: prompts, their lengths (per adapter) and wall seconds."""

    prompts: int
    lengths: tuple[int, ...]
    seconds: float

    def __str__(self) -> str:
        return (f"prompt steps warmed: {self.prompts} prompts of {self.lengths[0]} to "
                f"{self.lengths[-1]} tokens in {self.seconds:.1f} s")  # fmt: skip


def _cut(chunks: list[tuple[_Row, int, int]], tokens: int) -> list[tuple[_Row, int, int]]:
    """The chunks less their last `tokens` tokens (the newest rows' first); a row whose chunk
    is cut whole keeps its blocks and goes on prefilling next step."""
    chunks = list(chunks)
    while tokens > 0 and chunks:
        r, a, end = chunks[-1]
        take = min(tokens, end - a)
        tokens -= take
        chunks[-1:] = [] if take == end - a else [(r, a, end - take)]
    return chunks


def _prefill_groups(rows: list[_Row], budget: int, varlen: bool) -> list[list[_Row]]:
    """The rows grouped for one prefill forward each, in order of first appearance, each
    group cut to `budget` prompt tokens (a longer prompt alone): by prompt length on transformers' forward (no padding, so
    every row's last token is the forward's last), any lengths together with `varlen` (the
    runner packs them). Rows that ask for prompt logprobs form groups of their own."""
    groups: dict[tuple[int, bool], list[list[_Row]]] = {}
    for r in rows:
        length = len(r.request.prompt_ids)
        key = (0 if varlen else length, r.request.sampling.prompt_logprobs is not None)
        chunks = groups.setdefault(key, [[]])
        held = sum(len(c.request.prompt_ids) for c in chunks[-1])
        if chunks[-1] and held + length > budget:
            chunks.append([])
        chunks[-1].append(r)
    return [chunk for chunks in groups.values() for chunk in chunks]


def _eos_ids(model) -> frozenset[int]:
    """The model's eos ids (generation config first, then config; an int or a list)."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()
