"""The server's Prometheus metrics: moelora's own names, vLLM's names and labels beside them
(what a router reads: the Gateway API Inference Extension, llm-d, KServe), and what vLLM
does not export: which adapter is in which slot, adapter load times, requests and tokens per
adapter. The scheduler thread, the request readers and the adapter loaders write; the
/metrics handler reads (one lock). docs/serve.md lists every family.

moelora's counters: requests started (they passed the engine's check) and requests ended
by the reason their client read (stop, length, cancelled, error: every started request
ends in exactly one), requests refused before they started, prompt and generated tokens,
runtime adapter loads and unloads, adapter copies into slots and slot evictions, stall
reports (watchdog.py); gauges:
requests queued, rows running; histograms: time to first token and inter-token latency.

The paged KV cache's numbers (blocks held, preemptions, prefix-cache tokens queried and hit:
vLLM's kv_cache_usage_perc, num_preemptions, prefix_cache_queries / _hits) are read from
the engine on the scheduler thread, each time it reports the load (after every step), so a
scrape sees them as they were between two steps, never half-way through one.

Label values are bounded by the server's configuration, never by what clients send: the
per-adapter series name only adapters loaded now (a request can only run on one); the
counts of an adapter that was unloaded move to `adapter_name="__other__"`, so each series
and their sum only grow.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .exposition import Histogram, family, histograms
from .residency import residency_lines

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so a dashboard's quantiles read the
# same on both servers: time to first token, inter-token latency, end-to-end and queue time.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM's tokens per engine step, and its values of the n request parameter
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit` (--max-model-len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# Adapter loads (read, validate, write a slot): chosen to span a small adapter read from the
# page cache (a few ms) to a large one from network storage (tens of seconds).
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# vLLM's finish reasons (FinishReason), each exported from the start; the reason a client
# read maps onto them (a client that left: abort).
VLLM_REASONS = ("stop", "length", "abort", "error", "repetition")
TO_VLLM_REASON = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
# vLLM's help texts (vllm/v1/metrics/loggers.py)
VLLM_HELP = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "num_preemptions_total": "Cumulative number of preemption from the engine.",
    "prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
    "prompt_tokens_total": "Number of prefill tokens processed.",
    "generation_tokens_total": "Number of generation tokens processed.",
    "request_success_total": "Count of successfully processed requests.",
    "lora_requests_info": "Running stats on lora requests.",
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "time_per_output_token_seconds": "Histogram of time per output token in seconds. "
    "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per "
    "request.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "request_max_num_generation_tokens": "Histogram of maximum number of requested generation "
    "tokens.",
    "request_params_n": "Histogram of the n request parameter.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "cache_config_info": "Information of the LLMEngine CacheConfig",
}
OTHER = "__other__"  # the adapters unloaded since their requests were counted
ENGINE = "0"  # vLLM's `engine` label: this server runs one engine


@dataclass(frozen=True)
class KvCache:
    """The paged KV cache between two steps: blocks held and usable (the null block not
    among them), and since the start preemptions and prefix-cache tokens queried and hit."""

    used: int = 0
    capacity: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


def paged_cache_of(engine) -> Callable[[], KvCache] | None:
    """A reader of `engine`'s paged cache (moelora.engine.Engine: pool, preemptions), for
    Setting.kv_cache; None when its cache is not paged (rows of one slab each). Without
    prefix caching no prefix is looked up: 0 queries, as vLLM counts them. Preemptions
    count the rows suspended for another adapter's slot too (both resume by recompute)."""
    pool = engine.pool
    if pool is None:
        return None
    on = pool.prefix_caching
    return lambda: KvCache(
        pool.used, pool.capacity, engine.preemptions + getattr(engine, "suspensions", 0),
        pool.stats.queries if on else 0, pool.stats.hits if on else 0,
    )  # fmt: skip


def cache_config_of(engine, settings) -> tuple[tuple[str, str], ...]:
    """vllm:cache_config_info's labels (vLLM's CacheConfig field names) for `engine` served
    under `settings` (launch.ServeSettings): the blocks and their size on a paged engine;
    on a slab engine (one cache row of max_model_len per request) block_size is
    max_model_len and num_gpu_blocks the rows."""
    pool = engine.pool
    size = pool.block_size if pool is not None else engine.max_len
    blocks = pool.num_blocks if pool is not None else engine.max_rows
    caching = pool is not None and pool.prefix_caching
    return (
        ("block_size", str(size)), ("cache_dtype", "auto"),
        ("enable_prefix_caching", str(caching)),
        ("gpu_memory_utilization", str(settings.gpu_memory_utilization)),
        ("num_gpu_blocks", str(blocks)),
        ("num_gpu_blocks_override", str(settings.num_gpu_blocks_override)),
    )  # fmt: skip


@dataclass(frozen=True)
class RowEnd:
    """A row that ended, as vLLM's per-request histograms read it: seconds from submission
    to its end (e2e), from joining the engine to its first token (prefill), from the first token to the last (decode), from joining to its end
    (inference); its mean time per output token after the first (0 for one token or none);
    its prompt and generated tokens and its max_tokens (the engine's limit of new tokens)."""

    e2e_s: float
    prefill_s: float = 0.0
    decode_s: float = 0.0
    inference_s: float = 0.0
    per_token_s: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    max_tokens: int = 0


@dataclass(frozen=True)
class Setting:
    """What the metrics are labelled with: the served model's name (vLLM's `model_name`),
    --max-loras (`max_lora`), the engine's rows (the KV cache's), and whether a name is an
    adapter loaded now (per-adapter series keep only those). kv_cache: the paged cache's
    reader (paged_cache_of), called on the scheduler thread; None: the cache is one slab per
    row, its usage is rows running / rows, and nothing is preempted or cached. max_model_len
    bounds the token-count buckets; cache_config: the KV cache's settings (cache_config_of)."""

    model_name: str = ""
    max_loras: int = 0
    rows: int = 0
    is_loaded: Callable[[str], bool] = lambda name: False
    kv_cache: Callable[[], KvCache] | None = None
    max_model_len: int = 0  # the token-count histograms' last bucket (vLLM's 1-2-5 series)
    cache_config: tuple[tuple[str, str], ...] = ()  # vllm:cache_config_info's labels


class Metrics:
    def __init__(self, setting: Setting | None = None) -> None:
        self.setting = setting or Setting()
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # finish reason -> requests
        self.started_requests = 0
        self.refused_requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.adapter_loads = 0
        self.adapter_unloads = 0
        self.stall_reports = 0  # watchdog.py's reports: requests in flight past the deadline
        self.queued = 0
        self.running = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_BUCKETS)
        self.queue_time = Histogram(REQUEST_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)  # each request's mean time per output token
        self.inference_time = Histogram(REQUEST_BUCKETS)
        self.prefill_time = Histogram(REQUEST_BUCKETS)
        self.decode_time = Histogram(REQUEST_BUCKETS)
        counts = one_two_five(self.setting.max_model_len)
        self.request_prompt = Histogram(counts)
        self.request_generation = Histogram(counts)
        self.request_max_tokens = Histogram(counts)
        self.request_max_generation = Histogram(counts)  # per prompt: the most of its n rows
        self.request_n = Histogram(N_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_BUCKETS)
        self.load_time: dict[str, Histogram] = {}  # source (runtime, resolver) -> histogram
        self.per_adapter: dict[str, Counter[str]] = {}  # adapter -> requests, tokens
        self._lora_state: tuple[str, str] = ("", "")  # running, waiting adapters (joined)
        self._lora_time = time.time()
        self.kv = KvCache()  # the paged cache at the last report (zeros when not paged)

    # ---- the scheduler thread ------------------------------------------------------------

    def set_load(self, queued: int, running: int, running_adapters: Sequence = (),
                 waiting_adapters: Sequence = ()) -> None:  # fmt: skip
        """Requests queued and rows running, and the adapters of each (None: the base
        model), as vLLM's lora_requests_info reports them, stamped with the time; the paged
        cache's numbers read now (this thread drives the engine)."""
        running_names = ",".join(sorted({str(a) for a in running_adapters if a is not None}))
        waiting_names = ",".join(sorted({str(a) for a in waiting_adapters if a is not None}))
        kv = self.setting.kv_cache() if self.setting.kv_cache is not None else KvCache()
        with self._lock:
            self.queued, self.running, self.kv = queued, running, kv
            self._lora_state = (running_names, waiting_names)
            self._lora_time = time.time()

    def accepted(self, adapter: str | None, prompt_tokens: int) -> None:
        """A request of `adapter` passed the engine's check."""
        if adapter is not None:
            with self._lock:
                tally = self._adapter(adapter)
                tally["requests"] += 1
                tally["prompt_tokens"] += prompt_tokens

    def admitted(self, queued_s: float) -> None:
        """A request joined the engine `queued_s` seconds after it was submitted."""
        with self._lock:
            self.queue_time.observe(queued_s)

    def token(self, since: float, previous: float | None, adapter: str | None = None) -> None:
        """A generated token, `since` seconds after the last one (or the submission)."""
        with self._lock:
            self.generation_tokens += 1
            (self.ttft if previous is None else self.itl).observe(since)
            if adapter is not None:
                self._adapter(adapter)["generation_tokens"] += 1

    def ended(self, row: RowEnd) -> None:
        """A request's row ended (its times and counts: RowEnd)."""
        with self._lock:
            self.e2e.observe(row.e2e_s)
            self.tpot.observe(row.per_token_s)
            self.inference_time.observe(row.inference_s)
            self.prefill_time.observe(row.prefill_s)
            self.decode_time.observe(row.decode_s)
            self.request_prompt.observe(row.prompt_tokens)
            self.request_generation.observe(row.generation_tokens)
            if row.max_tokens:
                self.request_max_tokens.observe(row.max_tokens)

    def stepped(self, tokens: int) -> None:
        """An engine step (one that forwarded tokens) counted `tokens` as vLLM's
        iteration_tokens_total does: the tokens it sampled, and the prompts of the requests
        whose first token it sampled (the scheduler counts them)."""
        with self._lock:
            self.iteration_tokens.observe(tokens)

    def _adapter(self, name: str) -> Counter[str]:
        """Under the lock: the tally a count of `name` goes to (OTHER once it is unloaded)."""
        key = name if self.setting.is_loaded(name) else OTHER
        return self.per_adapter.setdefault(key, Counter())

    # ---- the request readers and loaders ------------------------------------------------

    def started(self, prompt_tokens: int) -> None:
        """A request passed the engine's check: it is counted again when it ends."""
        with self._lock:
            self.started_requests += 1
            self.prompt_tokens += prompt_tokens

    def refused(self) -> None:
        """A request refused before it started (the engine's check, a shutdown)."""
        with self._lock:
            self.refused_requests += 1

    def finished(self, reason: str) -> None:
        with self._lock:
            self.requests[reason] += 1

    def adapter(self, loaded: bool) -> None:
        """A runtime load (or unload) through /v1/load_lora_adapter."""
        with self._lock:
            if loaded:
                self.adapter_loads += 1
            else:
                self.adapter_unloads += 1

    def adapter_loaded(self, source: str, seconds: float) -> None:
        """An adapter read, checked and published while serving (`source`: runtime for
        /v1/load_lora_adapter, resolver for --lora-resolver-dir) in `seconds`."""
        with self._lock:
            self.load_time.setdefault(source, Histogram(LOAD_BUCKETS)).observe(seconds)

    def prompt_ended(self, n: int, most_generated: int) -> None:
        """The `n` choices of one prompt of a body (its `n`) have all ended, the longest
        with `most_generated` tokens."""
        with self._lock:
            self.request_n.observe(n)
            self.request_max_generation.observe(most_generated)

    def stall_reported(self) -> None:
        """The stall watchdog (watchdog.py) logged a report: a stall episode began."""
        with self._lock:
            self.stall_reports += 1

    # ---- /metrics -------------------------------------------------------------------------

    def render(self, handle) -> str:
        """The exposition text; slot residency and the slot manager's counters read from
        `handle` (moelora.hf's handle) now."""
        stats = handle.stats()  # the slot manager's lock, not taken under this one
        with self._lock:
            self._fold_unloaded()
            lines = self._moelora_lines(stats)
            lines += self._vllm_lines()
            lines += self._adapter_lines()
        return "\n".join([*lines, *residency_lines(handle, self.setting.max_loras)]) + "\n"

    def _fold_unloaded(self) -> None:
        """Under the lock: the counts of adapters no longer loaded move to OTHER for good."""
        for name in [n for n in self.per_adapter if n != OTHER]:
            if not self.setting.is_loaded(name):
                self.per_adapter.setdefault(OTHER, Counter()).update(self.per_adapter.pop(name))

    def _moelora_lines(self, stats) -> list[str]:
        lines = ["# TYPE moelora_requests_total counter"]
        lines += [f'moelora_requests_total{{finish_reason="{r}"}} {n}'
                  for r, n in sorted(self.requests.items())]  # fmt: skip
        for name, kind, value in (
            ("requests_started_total", "counter", self.started_requests),
            ("requests_refused_total", "counter", self.refused_requests),
            ("prompt_tokens_total", "counter", self.prompt_tokens),
            ("generation_tokens_total", "counter", self.generation_tokens),
            ("adapter_loads_total", "counter", self.adapter_loads),
            ("adapter_unloads_total", "counter", self.adapter_unloads),
            ("adapter_slot_loads_total", "counter", sum(stats.loads.values())),
            ("adapter_slot_load_seconds_total", "counter", sum(stats.load_seconds.values())),
            ("adapter_evictions_total", "counter", stats.evictions),
            ("stall_reports_total", "counter", self.stall_reports),
            ("requests_queued", "gauge", self.queued),
            ("rows_running", "gauge", self.running),
        ):
            lines += [f"# TYPE moelora_{name} {kind}", f"moelora_{name} {value}"]
        lines += histograms("moelora_time_to_first_token_seconds", None, [((), self.ttft)])
        lines += histograms("moelora_inter_token_latency_seconds", None, [((), self.itl)])
        return lines

    def _vllm_lines(self) -> list[str]:
        """vLLM's families under vLLM's names, labels and help texts."""
        engine = (("model_name", self.setting.model_name), ("engine", ENGINE))
        rows, kv = self.setting.rows, self.kv
        if self.setting.kv_cache is not None:  # paged: blocks held / blocks usable
            usage = kv.used / kv.capacity if kv.capacity else 0.0
        else:  # a row's KV cache is one slab of max_len positions, reserved whole while it runs
            usage = self.running / rows if rows else 0.0
        reasons = Counter({r: 0 for r in VLLM_REASONS})
        for reason, n in self.requests.items():
            reasons[TO_VLLM_REASON.get(reason, reason)] += n
        running, waiting = self._lora_state
        info = (("max_lora", str(self.setting.max_loras)), ("waiting_lora_adapters", waiting),
                ("running_lora_adapters", running))  # fmt: skip
        lines = []
        for name, kind, samples in (
            ("num_requests_running", "gauge", [(engine, self.running)]),
            ("num_requests_waiting", "gauge", [(engine, self.queued)]),
            ("kv_cache_usage_perc", "gauge", [(engine, usage)]),
            ("num_preemptions_total", "counter", [(engine, kv.preemptions)]),
            ("prefix_cache_queries_total", "counter", [(engine, kv.prefix_queries)]),
            ("prefix_cache_hits_total", "counter", [(engine, kv.prefix_hits)]),
            ("prompt_tokens_total", "counter", [(engine, self.prompt_tokens)]),
            ("generation_tokens_total", "counter", [(engine, self.generation_tokens)]),
            ("request_success_total", "counter",
             [((*engine, ("finished_reason", r)), n) for r, n in reasons.items()]),
            ("lora_requests_info", "gauge", [(info, self._lora_time)]),
            ("cache_config_info", "gauge",
             [((*self.setting.cache_config, ("engine", ENGINE)), 1)]),
        ):  # fmt: skip
            lines += family(f"vllm:{name}", kind, VLLM_HELP[name], samples)
        for name, histogram in (
            ("time_to_first_token_seconds", self.ttft),
            ("inter_token_latency_seconds", self.itl),
            ("time_per_output_token_seconds", self.itl),  # vLLM's older name of the same
            ("request_time_per_output_token_seconds", self.tpot),
            ("e2e_request_latency_seconds", self.e2e),
            ("request_queue_time_seconds", self.queue_time),
            ("request_inference_time_seconds", self.inference_time),
            ("request_prefill_time_seconds", self.prefill_time),
            ("request_decode_time_seconds", self.decode_time),
            ("request_prompt_tokens", self.request_prompt),
            ("request_generation_tokens", self.request_generation),
            ("request_params_max_tokens", self.request_max_tokens),
            ("request_max_num_generation_tokens", self.request_max_generation),
            ("request_params_n", self.request_n),
            ("iteration_tokens_total", self.iteration_tokens),
        ):
            lines += histograms(f"vllm:{name}", VLLM_HELP[name], [(engine, histogram)])
        return lines

    def _adapter_lines(self) -> list[str]:
        """Requests and tokens per adapter, and adapter load times."""
        lines = []
        for key, what in (("requests", "Requests started"),
                          ("prompt_tokens", "Prompt tokens of the requests started"),
                          ("generation_tokens", "Tokens generated")):  # fmt: skip
            tallies = sorted(self.per_adapter.items())
            lines += family(f"moelora_lora_{key}_total", "counter", f"{what}, per adapter.",
                            [((("adapter_name", a),), t[key]) for a, t in tallies])  # fmt: skip
        help_text = (
            "Seconds an adapter load took while serving (read, checked, written into a free slot)."
        )
        loads = [((("source", s),), h) for s, h in sorted(self.load_time.items())]
        return lines + histograms("moelora_lora_adapter_load_seconds", help_text, loads)
