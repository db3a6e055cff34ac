"""The load benchmark's rows (benchmarks/serve_load.py): a run's streamed requests summarised
(completed and failed with their errors, output tokens/s, TTFT and ITL percentiles), the
server's /metrics counters read before and after it (adapter copies into slots, preemptions
and the prefix-cache hit rate, each with the reason when it is 0 by construction, not
applicable or not exported), and the readable tables printed at the end."""

from __future__ import annotations

import collections

COPIES = "moelora_adapter_slot_loads_total"  # adapters copied into a device slot
COPY_SECONDS = "moelora_adapter_slot_load_seconds_total"  # the time those copies took
EVICTIONS = "moelora_adapter_evictions_total"  # slots given to another adapter
PREEMPTIONS = "vllm:num_preemptions_total"  # vLLM's names, read once the server exports them
PREFIX_HITS, PREFIX_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
READ = (COPIES, COPY_SECONDS, EVICTIONS, PREEMPTIONS, PREFIX_HITS, PREFIX_QUERIES)

# what a row says instead of a number while the server exports no such counter
NOT_EXPORTED = {
    "preemptions": f"not exported: the server's /metrics has no {PREEMPTIONS}",
    "prefix_cache_hit_rate": f"not exported: the server's /metrics has no {PREFIX_HITS} / "
    f"{PREFIX_QUERIES}",
}
# why a number the server exports is 0 or no rate, from its KV cache (kv_cache_of's dict)
SLAB = "the KV cache is not paged (transformers' forward: one slab of --max-model-len per row)"
NOT_APPLICABLE = {
    "preemptions": f"0 by construction: {SLAB}, so no running request is preempted",
    "prefix_cache_hit_rate": f"not applicable: {SLAB}, no prefix cache",
    "prefix_caching_off": "not applicable: the server runs with --no-enable-prefix-caching",
}


def counters(text: str) -> dict[str, float]:
    """The READ families of a Prometheus text page, each summed over its label sets; a
    family the server does not export is absent."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in READ:
            out[name] += float(line.rsplit(" ", 1)[1])
    return dict(out)


def percentile_ms(values: list[float], q: float) -> float | None:
    """The value at rank int(q x n) of the sorted values, in ms; None when there is none."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else None


def outcome(results: list[dict]) -> dict:
    """requests = completed + failed; the failures' errors, each with its count."""
    failed = collections.Counter(r["error"] for r in results if not r["ok"])
    return {"requests": len(results), "completed": len(results) - sum(failed.values()),
            "failed": sum(failed.values()), "errors": dict(failed)}  # fmt: skip


def server_counts(before: dict, after: dict, elapsed: float, kv: dict | None = None) -> dict:
    """The /metrics counters' growth over a run; `kv`: the server's KV cache as its startup
    line said (kv_cache_of), which says why a count is 0 or a rate missing."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in READ}
    row = {"adapter_copies": int(delta[COPIES]), "adapter_copies_per_s": delta[COPIES] / elapsed,
           "adapter_copy_seconds": delta[COPY_SECONDS],
           "adapter_evictions": int(delta[EVICTIONS])}  # fmt: skip
    paged = kv is None or kv["paged"]  # a server that does not say: taken as paged
    exported = PREEMPTIONS in after
    row["preemptions"] = int(delta[PREEMPTIONS]) if exported else 0
    row["preemptions_note"] = (NOT_EXPORTED["preemptions"] if not exported else None if paged
                               else NOT_APPLICABLE["preemptions"])  # fmt: skip
    exported = PREFIX_HITS in after and PREFIX_QUERIES in after
    queries = delta[PREFIX_QUERIES]
    row["prefix_cache_hit_rate"] = delta[PREFIX_HITS] / queries if exported and queries else None
    row["prefix_cache_note"] = _prefix_note(exported, queries, paged, kv)
    return row


def _prefix_note(exported: bool, queries: float, paged: bool, kv: dict | None) -> str | None:
    if not exported:
        return NOT_EXPORTED["prefix_cache_hit_rate"]
    if queries:
        return None
    if not paged:
        return NOT_APPLICABLE["prefix_cache_hit_rate"]
    if kv is not None and not kv["prefix_caching"]:
        return NOT_APPLICABLE["prefix_caching_off"]
    return "no prefix-cache query"


def kv_summary(kv: dict) -> str:
    """The server's KV cache in a few words (the table's last line)."""
    if kv["paged"]:
        return (f"{kv['blocks']} blocks x {kv['block_size']} positions, prefix caching "
                f"{'on' if kv['prefix_caching'] else 'off'}")  # fmt: skip
    return f"{kv['rows']} rows x {kv['positions']} positions (not paged)"


def level_row(
    results: list[dict], elapsed: float, before: dict, after: dict, kv: dict | None = None
) -> dict:
    """One run of a level: every request counted, latencies of the completed ones, the
    tokens of all (a failed request's streamed tokens were still produced); `kv`: the
    server's KV cache (server_counts)."""
    ok = [r for r in results if r["ok"]]
    ttft, itl = [r["ttft"] for r in ok], [g for r in ok for g in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {**outcome(results), "output_tokens": tokens, "seconds": elapsed,
            "output_tok_s": tokens / elapsed, "ttft_p50_ms": percentile_ms(ttft, 0.5),
            "ttft_p99_ms": percentile_ms(ttft, 0.99), "itl_p50_ms": percentile_ms(itl, 0.5),
            "itl_p99_ms": percentile_ms(itl, 0.99),
            **server_counts(before, after, elapsed, kv)}  # fmt: skip


def long_row(streams: list[dict], long: dict, before: list, during: list, through: int) -> dict:
    """The long-prompt scenario: the streams' gaps before it was sent and while it waited for
    its first token; `through`: streams still streaming after that first token."""
    p99 = percentile_ms(before, 0.99), percentile_ms(during, 0.99)
    return {**outcome([*streams, long]), "long_ttft_ms": long["ttft"] * 1e3 if long["ok"] else None,
            "itl_before_p50_ms": percentile_ms(before, 0.5), "itl_before_p99_ms": p99[0],
            "itl_during_p50_ms": percentile_ms(during, 0.5), "itl_during_p99_ms": p99[1],
            "itl_p99_during_over_before": p99[1] / p99[0] if None not in p99 and p99[0] else None,
            "gaps_before": len(before), "gaps_during": len(during),
            "streams_running_through": through}  # fmt: skip


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(doc: dict) -> str:
    """The levels and the long-prompt scenario as markdown rows, then the notes and errors."""
    out = ["", "| concurrency | run | requests (failed) | output tok/s | vs LoRA-free | TTFT p50 / "
           "p99 (ms) | ITL p50 / p99 (ms) | adapter copies/s | preemptions | prefix hit rate |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in doc["levels"]:
        out.append(
            f"| {r['concurrency']} | {r['run']} | {r['requests']} ({r['failed']}) | "
            f"{r['output_tok_s']:.1f} | {_f(r['vs_lora_free'], '.2f')} | "
            f"{_f(r['ttft_p50_ms'], '.0f')} / {_f(r['ttft_p99_ms'], '.0f')} | "
            f"{_f(r['itl_p50_ms'], '.1f')} / {_f(r['itl_p99_ms'], '.1f')} | "
            f"{r['adapter_copies_per_s']:.2f} | {r['preemptions']} | "
            f"{_f(r['prefix_cache_hit_rate'], '.2f') if r['prefix_cache_note'] is None else 'n/a'} |"
        )  # fmt: skip
    if doc["long_prompt"]:
        out += ["", "| run | streams | long prompt (tokens) | its TTFT (ms) | streams' ITL before "
                "p50 / p99 (ms) | during p50 / p99 (ms) | p99 during / before | requests (failed) |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in doc["long_prompt"]:
        out.append(
            f"| {r['run']} | {r['streams']} | {r['long_prompt_tokens']} | "
            f"{_f(r['long_ttft_ms'], '.0f')} | {_f(r['itl_before_p50_ms'], '.1f')} / "
            f"{_f(r['itl_before_p99_ms'], '.1f')} | {_f(r['itl_during_p50_ms'], '.1f')} / "
            f"{_f(r['itl_during_p99_ms'], '.1f')} | {_f(r['itl_p99_during_over_before'], '.2f')}x | "
            f"{r['requests']} ({r['failed']}) |"
        )  # fmt: skip
    out.append("")
    for key, note in (
        ("preemptions", "preemptions_note"),
        ("prefix hit rate", "prefix_cache_note"),
    ):
        out += [f"{key}: {n}" for n in sorted({r[note] for r in doc["levels"] if r[note]})]
    for r in [*doc["levels"], *doc["long_prompt"]]:
        out += [f"errors ({r['run']}): {n} x {e}" for e, n in r["errors"].items()]
    warm = doc.get("warmup", {})
    out += [f"errors (warm-up): {n} x {e}" for e, n in warm.get("errors", {}).items()]
    kv = doc["server"].get("kv_cache")
    out.append(f"warm-up: {warm.get('requests')} requests ({warm.get('failed')} failed); "
               f"KV cache: {kv_summary(kv) if kv else None}; server exit code after "
               f"SIGTERM: {doc['server'].get('exit_code')}")  # fmt: skip
    return "\n".join(out)
