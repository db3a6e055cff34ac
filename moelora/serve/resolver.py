"""`--lora-resolver-dir DIR`: a request naming an adapter the server does not know loads
DIR/<name>, as vLLM's filesystem resolver does (vllm/plugins/lora_resolvers/
filesystem_resolver.py), then runs on it.

A name resolves only inside DIR: a relative path of non-empty parts, none `.` or `..`, no
backslash or NUL, whose real path (links followed) lies strictly under DIR's real path; any
other name is an unknown model (404, the same words whether or not something exists where
it points). The directory's adapter_config.json must name the served model in
`base_model_name_or_path` (vLLM's check: the model as given on the command line; here also
its real path or --served-model-name). The adapter then goes through the loader a runtime
load uses, with every refusal it has (a refused load is a 400 naming why; nothing changes).

At most MAX_CONCURRENT_LOADS loads run at once (the others wait their turn, off the event
loop's threads); requests that name the same unknown adapter while it loads wait for that
one load and share its outcome. A resolved adapter stays loaded until
/v1/unload_lora_adapter removes it (which frees its slot and its host copy); a request naming
it again resolves it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from ..errors import MoeloraError
from ..lora.safe_io import read_config
from .context import ServeError, bad_request

log = logging.getLogger("moelora.serve")

# Loads at once: each reads and checks files in a worker thread, then writes a slot under
# the slot manager's one writer lock, so a second load overlaps one's file reads with the
# other's slot write; more would only queue on that lock while holding host memory.
MAX_CONCURRENT_LOADS = 2
NAME_MAX = 255  # the longest name a resolver looks up (a file name's limit on Linux)


def confined(root: Path, name: str) -> Path | None:
    """The real path of root/name when `name` stays inside `root` (see the module doc) and
    names a directory there; None otherwise. `root`: a real path (resolved)."""
    parts = name.split("/")
    if not name or len(name) > NAME_MAX or "\\" in name or "\x00" in name:
        return None
    if any(part in ("", ".", "..") for part in parts):  # also refuses "/abs" and "a//b"
        return None
    try:
        path = (root / name).resolve()
        inside = path != root and path.is_relative_to(root)
        return path if inside and path.is_dir() else None
    except (OSError, ValueError, RuntimeError):  # a link loop, an unreadable parent
        return None


def check_base(path: Path, name: str, base_names: frozenset[str]) -> None:
    """vLLM's resolver check: the adapter was trained for the model this server serves."""
    config = read_config(path)
    base = config.get("base_model_name_or_path")
    if base not in base_names:
        raise bad_request(
            f"adapter {name[:200]!r} in --lora-resolver-dir is for base model {base!r}: "
            f"expected base_model_name_or_path to be this server's model, one of "
            f"{sorted(base_names)} (set it in the adapter's adapter_config.json, or serve "
            "its base model)",
            "model",
        )


class LoraResolver:
    """Resolves unknown adapter names from `root` into `handle` (moelora.hf's handle).
    Used from the server's event loop only."""

    def __init__(self, root: Path, handle, base_names: frozenset[str], metrics,
                 max_loads: int = MAX_CONCURRENT_LOADS) -> None:  # fmt: skip
        self.root = root.resolve()
        self.handle, self.base_names, self.metrics = handle, base_names, metrics
        self._turns = asyncio.Semaphore(max_loads)
        self._loading: dict[str, asyncio.Future] = {}  # name -> its one load in flight

    def known(self, name: str) -> bool:
        return name in self.base_names or self.handle.version(name) is not None

    async def resolve(self, name: str) -> None:
        """Load `name` from the directory if it is unknown and resolves there; returns at
        once otherwise (an unknown name is then refused where every model is looked up).
        ServeError (400) when the adapter there is refused."""
        if self.known(name):
            return
        path = await asyncio.to_thread(confined, self.root, name)
        if path is None:
            return
        load = self._loading.get(name)
        if load is None:
            load = asyncio.ensure_future(self._load(name, path))
            self._loading[name] = load
            load.add_done_callback(lambda done: self._done(name, done))
        await asyncio.shield(load)  # a waiter that leaves does not cancel the others' load

    def _done(self, name: str, load: asyncio.Future) -> None:
        self._loading.pop(name, None)
        if not load.cancelled():
            load.exception()  # read: a failure with no waiter left is not logged as lost

    async def _load(self, name: str, path: Path) -> None:
        async with self._turns:
            if self.known(name):  # loaded meanwhile (a runtime load of the same name)
                return
            started = time.perf_counter()
            await asyncio.to_thread(self._load_now, name, path)
            self.metrics.adapter_loaded("resolver", time.perf_counter() - started)
        log.info("adapter %r resolved from %s", name, path)

    def _load_now(self, name: str, path: Path) -> None:
        try:
            check_base(path, name, self.base_names)
            self.handle.load_adapter(path, name)
        except ServeError:
            raise
        except MoeloraError as err:  # the loader's refusal: nothing changed
            # any client may name an adapter: the message shows paths from DIR on, not DIR
            why = str(err).replace(str(self.root), "<--lora-resolver-dir>")
            raise bad_request(f"adapter {name[:200]!r} not loaded: {why}", "model") from None
        except (OSError, ValueError) as err:
            log.info("resolving %r from %s failed: %r", name, path, err)
            raise bad_request(
                f"adapter {name[:200]!r} in --lora-resolver-dir is not a readable PEFT adapter "
                "directory: expected adapter_config.json and the adapter's weights", "model",
            ) from None  # fmt: skip
