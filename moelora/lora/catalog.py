"""AdapterCatalog: the adapters a SlotManager knows by name (more than it has slots), each a
PEFT directory (read and validated at first use) or an Adapter already read, in front of
the bounded HostCache of parsed ones.

`fetch(name)` returns the host copy: from the cache, else read (one reader per name at a
time; others asking for the same name wait for that read) and stored in the cache. A
registration changed while a read ran (replace, unregister) is never stored, and
`is_current` lets the caller throw away such a stale copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import AdapterError, InputError
from .adapter import Adapter
from .host_cache import HostCache
from .reports import LoadOrigin


@dataclass(frozen=True, eq=False)  # compared by identity: a new registration, a new object
class Source:
    """Where a registered name's weights are: a directory (with its load options) or an
    Adapter held in memory."""

    path: Path | None = None
    adapter: Adapter | None = None
    fused_orientation: str | None = None
    serves_non_expert: bool = False


@dataclass(frozen=True)
class Fetched:
    """A host copy ready for a slot write, where it came from and when the fetch began."""

    adapter: Adapter
    origin: LoadOrigin
    started: float  # time.perf_counter() at the fetch's start
    source: Source


class AdapterCatalog:
    """Thread-safe. `read(name, source)` turns a directory source into a validated Adapter."""

    def __init__(self, read: Callable[[str, Source], Adapter], cache: HostCache) -> None:
        self._read, self.cache = read, cache
        self._sources: dict[str, Source] = {}
        self._gates: dict[str, threading.Lock] = {}  # one read per name at a time
        self._lock = threading.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def __len__(self) -> int:
        return len(self._sources)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._sources)

    def register(self, name: str, source: Source) -> None:
        if not isinstance(name, str) or not name:
            raise InputError("adapter name", repr(name), "a non-empty string")
        if source.path is not None and not source.path.is_dir():
            raise AdapterError(str(source.path), "path", "no directory", "a PEFT adapter directory")
        with self._lock:
            if name in self._sources:
                raise InputError(
                    "adapter name",
                    repr(name),
                    "a name not registered yet (unregister() it first, or replace() it)",
                )
            self._sources[name] = source
            self._gates[name] = threading.Lock()

    def update(self, name: str, source: Source) -> None:
        """A registered name now stands for new weights (replace, or load under its name):
        the old host copy is dropped, and a read of the old source still running is not
        stored."""
        with self._lock:
            if name in self._sources:
                self._sources[name] = source
                self.cache.drop(name)

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self._sources:
                raise InputError(
                    "adapter name", repr(name), f"a registered adapter ({len(self._sources)})"
                )
            del self._sources[name]
            self._gates.pop(name, None)
            self.cache.drop(name)

    def is_current(self, name: str, fetched: Fetched) -> bool:
        return self._sources.get(name) is fetched.source

    def fetch(self, name: str) -> Fetched:
        """The host copy of a registered name (InputError for any other name)."""
        started = time.perf_counter()
        with self._lock:
            source, gate = self._sources.get(name), self._gates.get(name)
        if source is None or gate is None:
            raise InputError(
                "adapter name", repr(name), "a registered adapter (register() it first)"
            )
        with gate:
            hit = self.cache.get(name)
            if hit is not None and self._sources.get(name) is source:
                return Fetched(hit, LoadOrigin.HOST, started, source)
            if source.adapter is not None:
                adapter, origin = source.adapter, LoadOrigin.MEMORY
            else:
                adapter, origin = self._read(name, source), LoadOrigin.DISK
            host = self.cache.convert(adapter)
            with self._lock:
                if self._sources.get(name) is source:
                    self.cache.store(name, host)
        return Fetched(host, origin, started, source)
