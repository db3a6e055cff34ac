"""Adapters copied into a slot ahead of their requests, on a thread of their own: the
scheduler thread names the adapter admission.py chose (Plan.prefetch) and goes on stepping
while this thread holds it once (`handle.hold`: a registered adapter in no slot is copied
from the host cache into a slot, evicting the least recently used idle adapter; on CUDA on
the slot manager's side stream) and releases the hold at once, leaving it resident. Its
requests then join with no copy in the step's path.

A copy that fails (its directory gone, a refused adapter) is not retried: the adapter is
`uncopyable` and its requests join as before, where the engine's add() copies or refuses
it for them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable

log = logging.getLogger("moelora.serve")


class Prefetcher:
    """Copies adapters into slots through `handle.hold` (moelora.hf's handle) on its own
    thread, one at a time; `done` is called after each (the scheduler wakes on it)."""

    def __init__(self, handle, done: Callable[[], None]) -> None:
        self.handle, self.done = handle, done
        self._lock = threading.Lock()
        self._loading: dict[Hashable, str] = {}  # slot key -> adapter name, queued or copying
        self._failed: set[Hashable] = set()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.copies = 0  # holds that ended (a resident adapter's hold copies nothing)

    @property
    def loading(self) -> frozenset:
        with self._lock:
            return frozenset(self._loading)

    @property
    def uncopyable(self) -> frozenset:
        with self._lock:
            return frozenset(self._failed)

    def start(self, key: Hashable, name: str) -> None:
        """Copy adapter `name` (its current version is `key`) into a slot, unless it is
        being copied already or its copy failed before."""
        with self._lock:
            if key in self._loading or key in self._failed:
                return
            self._loading[key] = name
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="moelora-prefetch",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        self._queue.put((key, name))

    def close(self) -> None:
        """End the thread once the copies queued before are done."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, name = item
            try:
                for hold in self.handle.hold([name]):
                    hold.release()
            except Exception:
                log.warning("copying adapter %s ahead failed; its requests copy it", name,
                            exc_info=True)  # fmt: skip
                with self._lock:
                    self._failed.add(key)
            finally:
                with self._lock:
                    self._loading.pop(key, None)
                    self.copies += 1
                self.done()
