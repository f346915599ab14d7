"""AdapterRegistry: the cluster's adapter names (name -> source uri), persisted, and watched by the replicas.

Every change is written to disk atomically before it counts, so a restarted
tier forgets nothing, and bumps a generation. Replicas follow the registry
by long poll (watch), and each call says which generation its caller has
applied; settled() waits until every live watcher has applied a change. An
unload that returns after settled() has reached every replica: none serves
the adapter to a request that comes later.

Plain asyncio, no Ray: the tier (adapter_tier.py) owns one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
import uuid
from pathlib import Path

REGISTRY_FILE = "adapters.json"
# A watcher that has not called watch() for this long past its poll's timeout is gone (a replica that died).
WATCH_LEASE_GRACE_S = 5.0


class AdapterRegistry:
    def __init__(self, registry_dir: str | Path | None = None) -> None:
        self._path = Path(registry_dir) / REGISTRY_FILE if registry_dir is not None else None
        self._names: dict[str, str] = self._load()
        # A new epoch per registry object: a watcher of a restarted tier (generation 0 again) starts over.
        self.epoch = uuid.uuid4().hex
        self.generation = 0
        self._changed = asyncio.Event()  # set, and replaced, by every change
        self._acked = asyncio.Event()  # set, and replaced, by every watch() call
        self._watchers: dict[str, tuple[int, float]] = {}  # watcher -> (generation applied, lease end)

    def get(self, name: str) -> str | None:
        return self._names.get(name)

    def names(self) -> dict[str, str]:
        return dict(self._names)

    def set(self, name: str, uri: str | None) -> None:
        """Point name at uri (None: forget it) and persist that, or raise with the registry as it was."""
        previous = self._names.get(name)
        if previous == uri:
            return
        if uri is None:
            del self._names[name]
        else:
            self._names[name] = uri
        try:
            self._save()
        except BaseException:
            if previous is None:
                self._names.pop(name, None)
            else:
                self._names[name] = previous
            raise
        self.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- watchers ----------------------------------------------------------------------------------------

    async def watch(self, watcher: str, epoch: str | None, applied: int,
                    timeout_s: float = 10.0) -> tuple[str, int, dict[str, str]]:
        """(epoch, generation, names) once the registry is newer than the (epoch, applied) generation the
        watcher has applied, or after timeout_s as it is. The call is also the watcher's acknowledgement of
        `applied`, and keeps it live for timeout_s plus a grace."""
        current = epoch == self.epoch
        self._watchers[watcher] = (applied if current else -1, time.monotonic() + timeout_s + WATCH_LEASE_GRACE_S)
        self._acked.set()
        self._acked = asyncio.Event()
        if current and applied == self.generation:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self.epoch, self.generation, dict(self._names)

    async def settled(self, generation: int | None = None, timeout_s: float = 5.0) -> list[str]:
        """Wait until every live watcher has applied `generation` (default: the current one); returns the
        watchers still behind when timeout_s ran out (none: every replica has the change)."""
        generation = self.generation if generation is None else generation
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            self._watchers = {w: (g, end) for w, (g, end) in self._watchers.items() if end > now}
            behind = [w for w, (g, _) in self._watchers.items() if g < generation]
            if not behind or now >= deadline:
                return behind
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._acked.wait(), deadline - now)

    # ---- the file ----------------------------------------------------------------------------------------

    def _load(self) -> dict[str, str]:
        if self._path is None or not self._path.is_file():
            return {}
        # A file we cannot read is an error, not an empty registry: serving on would forget adapters.
        data = json.loads(self._path.read_text(encoding="utf-8"))
        return {str(k): str(v) for k, v in data["adapters"].items()}

    def _save(self) -> None:
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".adapters-", suffix=".json", dir=self._path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"adapters": self._names}, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)  # atomic: a crash leaves the old file or the new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
