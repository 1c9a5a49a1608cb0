"""The byte movers of the prefix cache's lower tiers (host memory, local disk), for the real engine.

The KV manager (kv/tiers.py) decides which block goes where and emits `TierOps`; this module
owns the bytes. The host tier is a CPU tensor laid out like the device cache, one row per block
(pinned on CUDA). The disk tier is a directory of one file per block, named by the block's key,
under a subdirectory named by a fingerprint of everything that decides the KV's bytes (model
file, dtype, weight quantization, block and head shapes): a worker restarted on the same
directory finds its blocks again, and a different model never reads them. Files are written to a
temporary name and renamed, so a crash mid-write leaves no torn block.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from sloserve.engine.model import KVCache
from sloserve.engine.swap import HostKVPool
from sloserve.kv.hashing import BlockHash
from sloserve.kv.tiers import DISK, HOST, STORE, TierOps

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"


def kv_fingerprint(model_id: str, dtype: torch.dtype, quantization: str, kv_cache: KVCache) -> str:
    """A short name for "KV computed by this model in this precision, stored in this dtype and block layout"."""
    text = "|".join([model_id, str(dtype), quantization, str(kv_cache.data.dtype), str(tuple(kv_cache.data.shape[:2])),
                     str(tuple(kv_cache.data.shape[3:])), str(kv_cache.block_size)])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def model_identity(path: Optional[str], name: str) -> str:
    """What names the weights on every host of a fleet: the file's name and size (not its path,
    which differs between hosts), or the model's name for the embedded default."""
    if path and os.path.isfile(path):
        return f"{os.path.basename(path)}:{os.path.getsize(path)}"
    return f"{path or ''}:{name}"


class DiskKVTier:
    """Blocks as files `<root>/<fingerprint>/<key hex>.kv`, raw bytes in the cache's layout."""

    def __init__(self, root: str | os.PathLike, fingerprint: str, kv_cache: KVCache) -> None:
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        L, two, _, heads, dim = kv_cache.data.shape
        self.block_shape = (L, two, kv_cache.block_size, heads, dim)
        self.dtype = kv_cache.data.dtype
        self.bytes_per_block = L * two * kv_cache.block_size * heads * dim * kv_cache.data.element_size()
        for tmp in self.dir.glob("*.tmp"):  # torn writes of a crashed run
            tmp.unlink(missing_ok=True)

    def path(self, key: BlockHash) -> Path:
        return self.dir / f"{key:032x}{_SUFFIX}"

    def stored_keys(self) -> list[BlockHash]:
        """Keys of the complete blocks on disk, oldest first (the LRU order to seed)."""
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(_SUFFIX):
                try:
                    st = entry.stat()
                    key = int(entry.name[:-len(_SUFFIX)], 16)
                except (OSError, ValueError):
                    continue
                if st.st_size == self.bytes_per_block:
                    found.append((st.st_mtime_ns, key))
        return [key for _, key in sorted(found)]

    def save(self, blocks: torch.Tensor, keys: list[BlockHash]) -> None:
        """`blocks`: (n, *block_shape) on the CPU, one per key."""
        data = blocks.contiguous().view(torch.uint8).numpy()
        for i, key in enumerate(keys):
            final = self.path(key)
            tmp = final.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(memoryview(data[i]))
            os.replace(tmp, final)

    def load(self, keys: list[BlockHash]) -> torch.Tensor:
        """(n, *block_shape) on the CPU. Raises OSError when a file is missing or short."""
        out = torch.empty((len(keys), *self.block_shape), dtype=self.dtype)
        raw = out.view(torch.uint8).numpy()
        for i, key in enumerate(keys):
            with open(self.path(key), "rb") as f:
                if f.readinto(memoryview(raw[i]).cast("B")) != self.bytes_per_block:
                    raise OSError(f"KV block file {self.path(key)} is short")
        return out

    def delete(self, keys: list[BlockHash]) -> None:
        for key in keys:
            self.path(key).unlink(missing_ok=True)

    def rank(self, keys: list[BlockHash]) -> None:
        """Give `keys`' files increasing modification times (the last one the newest), so a
        restart seeds its LRU order with them in that order (`stored_keys`); 1 us apart, as a
        coarse file-system clock could otherwise tie them. Missing files are skipped."""
        now = time.time_ns()
        for i, key in enumerate(keys):
            t = now - (len(keys) - i) * 1000
            try:
                os.utime(self.path(key), ns=(t, t))
            except OSError:
                pass


@dataclass
class TierMoveReport:
    """What one step's tier moves did: blocks and seconds per tier, and loads that failed
    (device blocks whose bytes did not arrive: the engine recomputes their requests)."""

    blocks: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    failed_blocks: set[int] = field(default_factory=set)
    lost_keys: set[int] = field(default_factory=set)  # prefetches that did not arrive: no tier holds them now

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


@dataclass
class FlushReport:
    """What a clean stop's flush to the disk tier did (LLMEngine.flush_tiers)."""

    order: str
    budget_s: float
    written: int = 0
    from_host: int = 0
    from_device: int = 0
    budget_out: int = 0  # left unwritten: the time budget ran out
    disk_full: int = 0  # left out: beyond the disk tier's bound, or a write failed (a full disk)
    off: int = 0  # left unwritten: the flush is off
    seconds: float = 0.0

    @property
    def dropped(self) -> int:
        return self.budget_out + self.disk_full + self.off

    def line(self) -> str:
        budget = "no" if self.budget_s == float("inf") else f"a {self.budget_s:.1f} s"
        return (f"KV shutdown flush ({self.order}): wrote {self.written} blocks to the disk tier in "
                f"{self.seconds:.2f} s ({self.from_host} from host memory, {self.from_device} from the device), "
                f"dropped {self.dropped} ({self.budget_out} when {budget} budget ran out, {self.disk_full} for a "
                f"full disk tier, {self.off} with the flush off)")


class TierMovers:
    """Carries out a step's `TierOps` on the engine's KV cache: drops, spills, saves, then loads."""

    def __init__(self, kv_cache: KVCache, host_blocks: int = 0, disk: Optional[DiskKVTier] = None,
                 store=None) -> None:
        self.kv_cache = kv_cache
        self.host = HostKVPool(kv_cache, host_blocks) if host_blocks > 0 else None
        self.disk = disk
        self.store = store  # a KVStoreClient (engine/kv_store.py) or None
        # Disk and store writes, and prefetches into host memory, run on this thread behind the
        # step's compute, in submission order; the next step's moves wait for them first (a drop
        # may delete a file being written, a save may reuse a host row being filled), and so
        # does a load from disk or the store in the same step (it may read a block just saved).
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tiers") \
            if disk is not None or store is not None else None
        self._pending: list[Future] = []
        self._bad_host_keys: set[int] = set()

    def finish_background(self, report: TierMoveReport) -> None:
        """Wait for the writes and prefetches in flight; prefetched keys that did not arrive are lost."""
        pending, self._pending = self._pending, []
        for future in pending:
            bad = future.result()  # (ran behind a step: not this step's time)
            if bad:
                self._bad_host_keys |= bad
                report.lost_keys |= bad

    def _write(self, target, data: torch.Tensor, keys: list, tier: str) -> set[int]:
        try:
            target.save(data, keys)
        except OSError as exc:  # a full disk or a lost store loses cache, never a request
            logger.warning("saving %d KV blocks to the %s tier failed: %s", len(keys), tier, exc)
        return set()

    def _read(self, tier: str, todo: list, what: str) -> Optional[torch.Tensor]:
        """The blocks of `todo` from the disk or the store, (n, *block_shape) on the CPU; None
        (logged) when any of them cannot be read."""
        source = self.disk if tier == DISK else self.store
        try:
            if source is None:
                raise OSError(f"no {tier} tier")
            return source.load([op.key for op in todo])
        except OSError as exc:
            logger.warning("%s %d KV blocks from the %s tier failed: %s", what, len(todo), tier, exc)
            return None

    def _promote(self, promotes: list) -> set[int]:
        bad: set[int] = set()
        assert self.host is not None
        for tier in (DISK, STORE):
            todo = [op for op in promotes if op.tier == tier]
            data = self._read(tier, todo, "prefetching") if todo else None
            if data is None:
                bad.update(op.key for op in todo)
                continue
            slots = torch.tensor([op.slot for op in todo], dtype=torch.long)
            self.host.data[:, :, slots] = data.permute(1, 2, 0, 3, 4, 5)
        return bad

    def _blocks(self) -> torch.Tensor:
        return HostKVPool._blocks(self.kv_cache)

    def flush(self, ops: list) -> tuple[int, int]:
        """Write a shutdown flush's `ops` (kv/tiers.FlushPlan: host rows and device blocks) to
        the disk now, on this thread; raises OSError (a full disk) with some maybe unwritten.
        Returns how many came from host memory and from the device."""
        assert self.disk is not None
        spills = [op for op in ops if op.block < 0]
        saves = [op for op in ops if op.block >= 0]
        if spills:
            assert self.host is not None
            slots = torch.tensor([op.slot for op in spills], dtype=torch.long)
            self.disk.save(self.host.data[:, :, slots].permute(2, 0, 1, 3, 4, 5), [op.key for op in spills])
        if saves:
            idx = torch.tensor([op.block for op in saves], dtype=torch.long, device=self.kv_cache.data.device)
            data = self._blocks().index_select(2, idx).to("cpu").permute(2, 0, 1, 3, 4, 5)
            self.disk.save(data, [op.key for op in saves])
        return len(spills), len(saves)

    def run(self, ops: TierOps) -> TierMoveReport:
        """Every move of `ops` (no swaps in between): saves, then loads; prefetches are waited for."""
        report = TierMoveReport()
        self.save(ops, report)
        self.load(ops, report)
        self.finish_background(report)
        return report

    @staticmethod
    def _timed(report: TierMoveReport, tier: str, n: int, t0: float) -> None:
        report.blocks[tier] = report.blocks.get(tier, 0) + n
        report.seconds[tier] = report.seconds.get(tier, 0.0) + time.perf_counter() - t0

    def save(self, ops: TierOps, report: TierMoveReport) -> None:
        """Drops and saves: they read device blocks that this step may reuse, so they run first
        (after the previous step's background work). Disk and store writes copy the blocks out
        now and write them behind the step."""
        self.finish_background(report)
        drops = [op.key for op in ops.drops if op.tier == DISK]
        if drops and self.disk is not None:
            self.disk.delete(drops)
        if ops.spills and self.disk is not None and self.host is not None and self._background is not None:
            # Host rows the disk takes over (write-back): read before this step's saves reuse them.
            slots = torch.tensor([op.slot for op in ops.spills], dtype=torch.long)
            data = self.host.data[:, :, slots].permute(2, 0, 1, 3, 4, 5)  # (indexing copies)
            self._pending.append(self._background.submit(self._write, self.disk, data,
                                                         [op.key for op in ops.spills], DISK))
        by_tier: dict[str, list] = {HOST: [], DISK: [], STORE: []}
        for op in ops.saves:
            by_tier[op.tier].append(op)
        if by_tier[HOST] and self.host is not None:
            t0 = time.perf_counter()
            self.host.swap_out(self.kv_cache, [(op.block, op.slot) for op in by_tier[HOST]])
            self._timed(report, HOST, len(by_tier[HOST]), t0)
        for tier, target in ((DISK, self.disk), (STORE, self.store)):
            saves = by_tier[tier]
            if saves and target is not None and self._background is not None:
                idx = torch.tensor([op.block for op in saves], dtype=torch.long, device=self.kv_cache.data.device)
                data = self._blocks().index_select(2, idx).to("cpu").permute(2, 0, 1, 3, 4, 5)  # a copy
                self._pending.append(self._background.submit(self._write, target, data, [op.key for op in saves], tier))

    def load(self, ops: TierOps, report: TierMoveReport) -> None:
        """Loads: they write device blocks, so they run after every read of the step (saves,
        swap-outs). A load that fails marks its device block in `report.failed_blocks`."""
        loads: dict[str, list] = {HOST: [], DISK: [], STORE: []}
        if any(op.tier != HOST for op in ops.loads):
            self.finish_background(report)  # a block saved in this very step is read back
        for op in ops.loads:
            if op.tier == HOST and op.key in self._bad_host_keys:
                report.failed_blocks.add(op.block)  # its prefetch never arrived
                continue
            loads[op.tier].append(op)
        self._bad_host_keys.clear()
        if loads[HOST] and self.host is not None:
            t0 = time.perf_counter()
            self.host.swap_in(self.kv_cache, [(op.slot, op.block) for op in loads[HOST]])
            self._timed(report, HOST, len(loads[HOST]), t0)
        for tier in (DISK, STORE):
            todo = loads[tier]
            if not todo:
                continue
            t0 = time.perf_counter()
            data = self._read(tier, todo, "loading (recomputing instead)")
            if data is None:
                report.failed_blocks.update(op.block for op in todo)
                continue
            idx = torch.tensor([op.block for op in todo], dtype=torch.long, device=self.kv_cache.data.device)
            self._blocks()[:, :, idx] = data.permute(1, 2, 0, 3, 4, 5).to(self.kv_cache.data.device)
            self._timed(report, tier, len(todo), t0)
        if self.kv_cache.data.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.data.device)
        if ops.promotes and self._background is not None and self.host is not None:
            self._pending.append(self._background.submit(self._promote, list(ops.promotes)))
