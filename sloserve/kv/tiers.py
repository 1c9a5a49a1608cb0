"""The KV tiers below the device pool: host memory, local disk, a shared store. Bookkeeping only.

A full block evicted from the device pool is *demoted*, not dropped. With a host tier it goes
there, and the disk receives what the host tier evicts in turn (write-back: a disk written at a
few GB/s only takes what memory cannot keep); without one it goes straight to the disk. The
shared store is written through (other instances read it). With `write_back=False` every tier
lacking the block gets it at once (as LMCache writes to each configured backend). Writes to the
disk and the store are paced to what their links carry behind the steps (`write_rates`,
`pace_writes`): a save that would fall behind is skipped, costing a future hit, never a stalled
step. A prefix whose leading blocks the device lost but a
lower tier keeps is *loaded* back into fresh device blocks when that costs less than recomputing
it (the scheduler prices both). This module decides which key goes where and records the byte
moves as `TierOp`s; the engine's movers (or the simulator's cost model) carry them out, in the
order `StepPlan` documents: saves (they read device blocks about to be reused) before loads.

A clean stop flushes what only host memory and the device hold to the disk (write-back owes the
disk those blocks): `plan_flush` ranks them (FLUSH_ORDERS) and leaves out what the disk cannot
hold; the engine writes them best first until its time budget runs out, registering each written
batch with `flushed`.

Host and disk are local LRU sets with a capacity in blocks. The shared store is reached through
`SharedIndex`: its contents change under us (other instances write to it), so presence is asked
of it, never assumed. Keys carry the tenant salt (see hashing), so a tier never serves one
tenant's blocks to another: they simply have different keys.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, Sequence

from sloserve.core.config import KV_FLUSH_ORDERS
from sloserve.kv.hashing import BlockHash

HOST, DISK, STORE = "host", "disk", "store"
TIERS = (HOST, DISK, STORE)  # the default search order (KVTiers.prefer sorts them by measured cost)


@dataclass(frozen=True, slots=True)
class TierOp:
    """Move one block between a device block and a tier: a save (device -> tier), a load
    (tier -> device), a spill (host row `slot` -> disk; `block` is -1) or a drop (the tier
    forgets `key`; `block` is -1). `slot` is the row of the host tier's tensor; the disk and
    the store address blocks by key."""

    tier: str
    key: BlockHash
    block: int
    slot: int = -1


@dataclass
class TierOps:
    """The tier moves of one step, in the order they run."""

    drops: list[TierOp] = field(default_factory=list)
    # Blocks the host tier evicts to the disk (write-back): read from their host rows before this
    # step's saves reuse those rows; the disk write itself runs behind the step.
    spills: list[TierOp] = field(default_factory=list)
    saves: list[TierOp] = field(default_factory=list)
    # Prefetches of a waiting request's prefix from disk or the store into the host tier
    # (`tier` is the source, `slot` the host row; `block` is -1): they run behind the step.
    promotes: list[TierOp] = field(default_factory=list)
    loads: list[TierOp] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.drops or self.spills or self.saves or self.promotes or self.loads)


@dataclass
class FlushPlan:
    """What a clean stop writes to the disk tier: `ops` best first, each a spill (host row
    `slot` -> disk) or a save (device block `block` -> disk); `disk_full` more were left out
    because the disk tier cannot hold them beside the better ones."""

    ops: list[TierOp] = field(default_factory=list)
    disk_full: int = 0
    order: str = "most-reused"
    off: int = 0  # with order "off": the blocks that would have been written


# How a clean stop ranks the blocks it owes the disk. Measured (benchmarks/kv_shutdown_flush.py:
# 12 three-turn chats, a stop, a disk-only restart replaying the first turns): with a disk that
# holds all of it both orders leave 98.4% of the replayed prompt tokens cached; with one that
# holds 145 of the 394 blocks owed, most-reused 47.5%, newest 40.3%.
# - most-reused: most prefix hits first (on the device or loaded from a tier), newest first among
#   equals. A block's hits are never more than its parent's (a hit is a leading run of a prompt),
#   so a chain is written from its head, and a prefix many requests shared (a system prompt, a
#   chat's first turns) before the tails only one request read;
# - newest: most recently used first (the host tier's blocks left the device before any block
#   the device still caches was last freed, so host LRU order, then the device's);
# - off: write nothing (the disk keeps only what reached it while serving).
FLUSH_ORDERS = KV_FLUSH_ORDERS
# Reuse counts kept at most (keys leave the count when they leave the device and host memory; a
# block dropped behind the tiers' back, e.g. a migration reserving it, is pruned at this bound).
MAX_COUNTED_KEYS = 1 << 18


NO_OPS = TierOps()  # shared by every step that moves nothing; never appended to (only KVTiers._ops is)


@dataclass
class TierStats:
    saved: int = 0  # blocks written to the tier
    loaded: int = 0  # blocks read back to the device (prefix hits served from the tier)
    dropped: int = 0  # blocks the tier evicted to make room
    skipped: int = 0  # saves left out because the tier's writes were behind (pacing)


class SharedIndex(Protocol):
    """A fleet-wide block store as the KV manager sees it: a Valkey/Redis server through the
    engine's client, or the simulator's fleet store."""

    def leading(self, keys: Sequence[BlockHash]) -> int:
        """How many of `keys`, from the first, the store holds now."""
        ...

    def saved(self, keys: Iterable[BlockHash]) -> None:
        """`keys` were written (by this instance's next step): count them as present."""
        ...

    def forget(self, keys: Iterable[BlockHash]) -> None:
        """A load of `keys` failed: do not count them as present any more."""
        ...


class LocalTier:
    """An LRU set of block keys with a fixed capacity: the host-memory or the local-disk tier.

    Slotted tiers (host) also give each key a row of the engine's tensor; the row of an evicted
    key is reused by the key that evicted it. Keys `busy` in this step (being loaded) are never
    evicted: the load reads them after the saves have run.
    """

    def __init__(self, name: str, capacity: int, slotted: bool = False) -> None:
        if capacity < 0:
            raise ValueError(f"{name} tier capacity must be >= 0 blocks, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.slotted = slotted
        self._keys: OrderedDict[BlockHash, int] = OrderedDict()  # key -> slot (-1 when not slotted); LRU first
        self._free_slots = list(range(capacity - 1, -1, -1)) if slotted else []
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._keys

    def keys(self) -> list[BlockHash]:
        """Held keys, least recently used first."""
        return list(self._keys)

    def slot_of(self, key: BlockHash) -> int:
        return self._keys[key]

    def touch(self, key: BlockHash) -> None:
        self._keys.move_to_end(key)

    def admit(self, key: BlockHash, busy: set[BlockHash]) -> Optional[tuple[int, Optional[BlockHash]]]:
        """Make `key` resident: (its slot, the key evicted for it or None), or None when the
        tier is full of busy keys (or has no capacity) and cannot take it now."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return self._keys[key], None
        if self.capacity == 0:
            return None
        dropped = None
        if len(self._keys) >= self.capacity:
            dropped = next((k for k in self._keys if k not in busy), None)
            if dropped is None:
                return None
            slot = self._keys.pop(dropped)
            self.stats.dropped += 1
        else:
            slot = self._free_slots.pop() if self.slotted else -1
        self._keys[key] = slot
        return slot, dropped

    def discard(self, key: BlockHash) -> None:
        slot = self._keys.pop(key, None)
        if slot is not None and self.slotted:
            self._free_slots.append(slot)

    def seed(self, keys: Iterable[BlockHash]) -> list[BlockHash]:
        """Register keys already stored (a disk tier found at start-up), oldest first. Returns
        those beyond the capacity (the oldest), which the caller should delete."""
        for key in keys:
            self._keys[key] = self._free_slots.pop() if self.slotted else -1
            self._keys.move_to_end(key)
        extra: list[BlockHash] = []
        while len(self._keys) > self.capacity:
            key, slot = self._keys.popitem(last=False)
            if self.slotted:
                self._free_slots.append(slot)
            extra.append(key)
        return extra

    def clear(self) -> list[BlockHash]:
        """Forget every key (e.g. the weights changed). Returns them, for the mover to delete."""
        keys = list(self._keys)
        if self.slotted:
            self._free_slots = list(range(self.capacity - 1, -1, -1))
        self._keys.clear()
        return keys

    def check_invariants(self) -> None:
        assert len(self._keys) <= self.capacity, (self.name, len(self._keys), self.capacity)
        if self.slotted:
            slots = list(self._keys.values()) + self._free_slots
            assert sorted(slots) == list(range(self.capacity)), f"{self.name}: slots leaked or doubled"


@dataclass(frozen=True, slots=True)
class TierHit:
    """A block of a prompt's prefix found below the device: where it is and under which key."""

    tier: str
    key: BlockHash
    slot: int = -1


# Saves a paced tier may catch up on at once: this many seconds of its link (about one step), so
# the writes behind a step stay about as long as the step.
WRITE_BURST_S = 0.1


class KVTiers:
    """The lower tiers of one instance and the moves planned for the next step."""

    def __init__(self, host_blocks: int = 0, disk_blocks: int = 0, store: Optional[SharedIndex] = None,
                 write_back: bool = True) -> None:
        self.host = LocalTier(HOST, host_blocks, slotted=True) if host_blocks > 0 else None
        self.disk = LocalTier(DISK, disk_blocks) if disk_blocks > 0 else None
        self.store = store
        self.write_back = write_back and self.host is not None and self.disk is not None
        # Blocks per second each paced tier's writes may take (the scheduler sets them from its
        # tier costs: disk and store); a tier not named here is written without pacing.
        self.write_rates: dict[str, float] = {}
        self._credit: dict[str, float] = {}
        self._paced_at: Optional[float] = None
        self.store_stats = TierStats()
        self._ops = TierOps()
        self._busy: set[BlockHash] = set()  # keys loaded by the step being planned
        self.order: tuple[str, ...] = TIERS  # where a block is taken from when several tiers hold it
        # Prefix hits per key held on the device or in host memory (with a disk tier only: they
        # rank the shutdown flush). Keys without a hit are not stored.
        self._uses: dict[BlockHash, int] = {}

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None or self.store is not None

    def local(self) -> list[LocalTier]:
        return [t for t in (self.host, self.disk) if t is not None]

    def stats(self) -> dict[str, TierStats]:
        out = {t.name: t.stats for t in self.local()}
        if self.store is not None:
            out[STORE] = self.store_stats
        return out

    # ---- pacing -----------------------------------------------------------------------
    def pace_writes(self, now: float) -> None:
        """A step is being planned at `now`: the paced tiers' links have carried what the time
        since the last step allows, up to WRITE_BURST_S of saves."""
        if not self.write_rates:
            return
        elapsed = WRITE_BURST_S if self._paced_at is None else max(0.0, now - self._paced_at)
        self._paced_at = now
        for tier, rate in self.write_rates.items():
            self._credit[tier] = min(rate * WRITE_BURST_S, self._credit.get(tier, 0.0) + rate * elapsed)

    def _may_write(self, tier: str) -> bool:
        if tier not in self.write_rates:
            return True
        credit = self._credit.get(tier, 0.0)
        if credit < 1.0:
            self.stats()[tier].skipped += 1
            return False
        self._credit[tier] = credit - 1.0
        return True

    # ---- planning ---------------------------------------------------------------------
    def demote(self, block: int, key: BlockHash) -> None:
        """A full cached device block is being reused: save it to the host tier (the disk gets
        it when the host evicts it), or without write-back to every tier that lacks it; and to
        the store. A key found in a tier for this step is skipped: if it is being loaded, its
        device block holds the bytes only once the load has run (and a tier holds it: it was
        found there)."""
        if key in self._busy:
            return
        uses = self._uses.pop(key, 0) if self._uses else 0  # the device copy is going: kept if host memory keeps it
        for tier in ([self.host] if self.write_back else self.local()):
            present = key in tier
            if not present and not self._may_write(tier.name):
                continue
            admitted = tier.admit(key, self._busy)
            if admitted is None or present:
                continue
            slot, dropped = admitted
            if dropped is not None:
                self._evicted(tier, dropped, slot)
            self._ops.saves.append(TierOp(tier.name, key, block, slot))
            tier.stats.saved += 1
        if uses and self.host is not None and key in self.host:
            self._uses[key] = uses
        if self.store is not None and not self.store.leading([key]) and self._may_write(STORE):
            self._ops.saves.append(TierOp(STORE, key, block))
            self.store.saved([key])
            self.store_stats.saved += 1

    def _evicted(self, tier: LocalTier, key: BlockHash, slot: int) -> None:
        """`tier` evicted `key` (from host row `slot`) to make room: with write-back, a host
        eviction goes on to the disk."""
        cancelled = self._forget(tier, key)
        if tier is self.host:
            self._uses.pop(key, None)
        disk = self.disk
        if not (self.write_back and tier is self.host and disk is not None) or key in disk:
            return
        if not self._may_write(DISK):
            return
        admitted = disk.admit(key, self._busy)
        if admitted is None:
            return
        if admitted[1] is not None:
            self._forget(disk, admitted[1])
        if cancelled is not None:  # its host save has not run: the disk takes it from the device block
            self._ops.saves.append(TierOp(DISK, key, cancelled.block))
        else:
            self._ops.spills.append(TierOp(DISK, key, -1, slot))
        disk.stats.saved += 1

    def _forget(self, tier: LocalTier, key: BlockHash) -> Optional[TierOp]:
        """`tier` evicted `key`: cancel its save (or spill) if this step has not run it yet, and
        return the cancelled save; else have the mover delete it (a host row needs nothing: the
        save that evicted it overwrites it)."""
        for moves in (self._ops.saves, self._ops.spills):
            for i, op in enumerate(moves):
                if op.tier == tier.name and op.key == key:
                    del moves[i]
                    tier.stats.saved -= 1
                    return op if moves is self._ops.saves else None
        if not tier.slotted:
            self._ops.drops.append(TierOp(tier.name, key, -1))
        return None

    def find(self, keys: Sequence[BlockHash]) -> list[TierHit]:
        """The leading run of `keys` held in some lower tier, stopping at the first block no tier
        holds; each block from the first tier of `order` that has it (the cheapest to load)."""
        hits: list[TierHit] = []
        store = self.store
        # The store holds keys[q_start:q_start + q] (asked in one round trip, from the start when
        # it is preferred to a local tier, else only once the local tiers run out).
        q_start, q = 0, 0
        if store is not None and self.order.index(STORE) < len(self.order) - 1:
            q = store.leading(keys)
        for i, key in enumerate(keys):
            hit = self._cheapest(key, q_start <= i < q_start + q)
            if hit is None and store is not None and not q_start <= i < q_start + q:
                q_start, q = i, store.leading(keys[i:])
                hit = self._cheapest(key, q > 0)
            if hit is None:
                break
            hits.append(hit)
        # Held until the step after next: the allocation that makes room for loading them
        # must not evict them from their tier first.
        self._busy.update(h.key for h in hits)
        return hits

    def _cheapest(self, key: BlockHash, in_store: bool) -> Optional[TierHit]:
        for name in self.order:
            if name == STORE:
                if in_store:
                    return TierHit(STORE, key)
                continue
            tier = self.host if name == HOST else self.disk
            if tier is not None and key in tier:
                return TierHit(name, key, tier.slot_of(key))
        return None

    def prefer(self, seconds_per_block: dict[str, float]) -> None:
        """Search the tiers cheapest first (a store over a fast fabric can beat a local disk)."""
        self.order = tuple(sorted(TIERS, key=lambda t: (seconds_per_block.get(t, float("inf")), TIERS.index(t))))

    def load(self, hits: Sequence[TierHit], blocks: Sequence[int]) -> None:
        """Plan to copy each hit into the device block beside it (in this step, before compute)."""
        if self.disk is not None:
            self.reused(hit.key for hit in hits)
        for hit, block in zip(hits, blocks, strict=True):
            self._busy.add(hit.key)
            self._ops.loads.append(TierOp(hit.tier, hit.key, block, hit.slot))
            if hit.tier == STORE:
                self.store_stats.loaded += 1
            else:
                tier = self.host if hit.tier == HOST else self.disk
                assert tier is not None
                tier.touch(hit.key)
                tier.stats.loaded += 1

    def lost(self, key: BlockHash) -> None:
        """A load of `key` failed (its file vanished, the store dropped it): no tier is trusted
        with it any more, so the retry recomputes it."""
        for tier in self.local():
            tier.discard(key)
        self._uses.pop(key, None)
        if self.store is not None:
            self.store.forget([key])

    def prefetch(self, hits: Sequence[TierHit]) -> int:
        """Copy the disk or store hits of a request still waiting into the host tier, so its
        admission loads them over the fast link. Returns how many were planned."""
        host = self.host
        if host is None:
            return 0
        n = 0
        for hit in hits:
            if hit.tier == HOST or hit.key in host:
                continue
            admitted = host.admit(hit.key, self._busy)
            if admitted is None:
                break
            slot, dropped = admitted
            if dropped is not None:
                self._evicted(host, dropped, slot)
            self._busy.add(hit.key)
            self._ops.promotes.append(TierOp(hit.tier, hit.key, -1, slot))
            host.stats.saved += 1
            n += 1
        return n

    def take_ops(self) -> TierOps:
        """The moves planned since the last call, for the step about to be planned. Keys loaded
        or prefetched by it stay unevictable until the next call; the previous step's are free."""
        ops = self._ops
        if not ops and not self._busy:
            return NO_OPS  # nothing planned, nothing held: the common step of a fleet without tiers
        self._ops = TierOps()
        self._busy = {op.key for op in ops.loads} | {op.key for op in ops.promotes}
        return ops

    def clear(self) -> None:
        """Forget every local key (the weights changed): pending saves are cancelled and the
        next step's moves drop what the tiers held."""
        ops = TierOps()
        for tier in self.local():
            ops.drops.extend(TierOp(tier.name, key, -1) for key in tier.clear())
        self._ops = ops
        self._busy = set()
        self._uses.clear()

    # ---- the shutdown flush ---------------------------------------------------------------
    def reused(self, keys: Iterable[BlockHash]) -> None:
        """Prefix hits on `keys` (found cached on the device, or loaded from a tier): counted
        only with a disk tier, where they rank the shutdown flush."""
        if self.disk is None:
            return
        uses = self._uses
        for key in keys:
            uses[key] = uses.get(key, 0) + 1
        if len(uses) > MAX_COUNTED_KEYS:  # keys that left behind the tiers' back: keep host memory's
            host = self.host
            self._uses = {k: n for k, n in uses.items() if host is not None and k in host}

    def uses(self, key: BlockHash) -> int:
        return self._uses.get(key, 0)

    def plan_flush(self, device: Iterable[tuple[int, BlockHash]], order: str) -> FlushPlan:
        """A clean stop: rank the blocks the disk tier lacks that host memory or the device pool
        holds (`device`: its cached blocks as (block id, key), least recently used first), by
        `order` (FLUSH_ORDERS), leaving out what the disk tier cannot hold. A key both in host
        memory and on the device is read from the device (its newer copy). Writing them is the
        engine's, best first, within its time budget; each written batch goes to `flushed`."""
        if order not in FLUSH_ORDERS:
            raise ValueError(f"flush order must be one of {', '.join(FLUSH_ORDERS)}, got {order!r}")
        disk = self.disk
        if disk is None:
            return FlushPlan(order=order)
        on_device = [(block, key) for block, key in device if key not in disk]
        device_keys = {key for _, key in on_device}
        ops: list[TierOp] = []
        if self.host is not None:  # older than every block the device still caches
            ops = [TierOp(DISK, key, -1, self.host.slot_of(key)) for key in self.host.keys()
                   if key not in disk and key not in device_keys]
        ops.extend(TierOp(DISK, key, block) for block, key in on_device)
        if order == "off":
            return FlushPlan(order=order, off=len(ops))
        ops.reverse()  # newest first
        if order == "most-reused":
            ops.sort(key=lambda op: -self._uses.get(op.key, 0))  # stable: newest first among equals
        # The flush may evict what the disk held before (least recently used first), never what
        # it writes itself: beyond the disk's capacity the worst-ranked blocks are left out.
        keep = ops[:disk.capacity]
        return FlushPlan(keep, len(ops) - len(keep), order)

    def flushed(self, ops: Sequence[TierOp], keep: set[BlockHash]) -> list[BlockHash]:
        """`ops` of a flush plan are about to be written to the disk: register them there.
        Returns the keys the disk tier evicted for them (least recently used first, never one of
        `keep`, the keys this flush writes), whose files the caller deletes."""
        disk = self.disk
        assert disk is not None
        evicted = []
        for op in ops:
            admitted = disk.admit(op.key, keep)
            if admitted is None:  # (cannot happen: the plan fits the disk's capacity)
                continue
            if admitted[1] is not None:
                evicted.append(admitted[1])
            disk.stats.saved += 1
        return evicted

    def unflushed(self, keys: Iterable[BlockHash]) -> None:
        """Writing these flushed keys failed: the disk tier does not hold them."""
        disk = self.disk
        assert disk is not None
        for key in keys:
            if key in disk:
                disk.discard(key)
                disk.stats.saved -= 1

    def check_invariants(self) -> None:
        for tier in self.local():
            tier.check_invariants()
