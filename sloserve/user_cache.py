"""Where sloserve keeps what it measured once and reads again (`$SLOSERVE_CACHE_DIR`, else
`$XDG_CACHE_HOME/sloserve`, else `~/.cache/sloserve`): the CPU's dtype probe, autoscaling's
capacity model. The test suite points `$SLOSERVE_CACHE_DIR` at a folder of its own: probes timed
while tests run side by side are noisy and must not become what `sloserve serve` reads."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Optional

logger = logging.getLogger(__name__)


CACHE_DIR_ENV = "SLOSERVE_CACHE_DIR"


def user_cache_path(name: str) -> Path:
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]) / name
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sloserve" / name


def source_fingerprint(paths: Iterable[Path]) -> str:
    """A digest of source files: a cached answer computed by older code is not reused."""
    h = hashlib.blake2b(digest_size=12)
    for path in sorted(paths):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class JsonCache:
    """A small key -> JSON value file, read once and rewritten atomically on each put (merged
    with what other processes wrote meanwhile); a file that cannot be read or written costs the
    cache, never the caller (logged)."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path  # None: in memory only
        self._entries: Optional[dict] = None

    def _read(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            loaded = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the unreadable cache %s: %s", self.path, exc)
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def get(self, key: str) -> object:
        if self._entries is None:
            self._entries = self._read()
        return self._entries.get(key)

    def put(self, key: str, value: object) -> None:
        entries = {**(self._entries or {}), **self._read(), key: value}
        self._entries = entries
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as exc:
            logger.warning("could not write the cache %s: %s", self.path, exc)
