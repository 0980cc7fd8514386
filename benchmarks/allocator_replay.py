"""CUDA's caching allocator replayed over an allocation log: what
``torch.cuda.max_memory_allocated`` counts, and which blocks it holds at its peak.
Pure Python: the log comes from ``peak_memory.py``'s replay of a step on the CPU, or
from a GPU run's own trace (``read_snapshot``: ``benchmarks/step.py
--memory-history``)."""

from __future__ import annotations

import bisect
import collections
import difflib
import importlib.util
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

BLOCK = 512  # the caching allocator's rounding (kMinBlockSize)

# Where a block is said to be made: the innermost frame in kvtrain's or megatron-core's
# package, named from the folder that holds the package, not the CPU backend's
# factory wrappers. Found, not imported (megatron's import warnings).
_PACKAGES = {name: os.path.dirname(os.path.abspath(importlib.util.find_spec(name).origin))
             for name in ("kvtrain", "megatron.core")}
OWN = {folder + os.sep: os.path.dirname(folder) if name == "kvtrain"
       else os.path.dirname(os.path.dirname(folder)) for name, folder in _PACKAGES.items()}
PASSING = os.path.join(_PACKAGES["kvtrain"], "backend", "cpu.py")


def site(filename: str, line, function: str) -> Optional[str]:
    """``path:line function`` of a frame in kvtrain or megatron-core (the path from
    the folder holding the package), None for any other frame."""
    if filename == PASSING:
        return None
    root = next((r for folder, r in OWN.items() if filename.startswith(folder)), None)
    return None if root is None else f"{os.path.relpath(filename, root)}:{line} {function}"


def block_bytes(nbytes: int) -> int:
    """What the caching allocator counts for a request of ``nbytes``."""
    return 0 if nbytes == 0 else -(-nbytes // BLOCK) * BLOCK


@dataclass
class Block:
    """One allocation: its size and where it was made."""
    size: int
    site: str  # the innermost kvtrain/megatron frame: path:line function
    op: str
    phase: str
    shape: tuple
    dtype: str

    def key(self) -> tuple:
        return (self.phase, self.site, self.op, self.dtype)


class Log:
    """Allocations and frees in order (each block's size as the allocator rounds it),
    the running total and its peak."""

    def __init__(self) -> None:
        self.events: list[tuple[int, Block]] = []  # (+1 allocated | -1 freed, block)
        self.total = self.peak = 0
        self.peak_at = 0  # len(events) at the peak
        self.peak_op = ""

    def count(self, sign: int, block: Block, doing: str = "") -> None:
        self.total += sign * block.size
        self.events.append((sign, block))
        if self.total > self.peak:
            self.peak, self.peak_at, self.peak_op = self.total, len(self.events), doing

    def at_peak(self) -> dict[tuple, list[Block]]:
        """(phase, site, op, dtype) -> the blocks of that kind alive at the peak."""
        alive: dict[int, Block] = {}
        for sign, block in self.events[:self.peak_at]:
            if sign > 0:
                alive[id(block)] = block
            else:
                del alive[id(block)]
        kinds: dict[tuple, list[Block]] = collections.defaultdict(list)
        for block in alive.values():
            kinds[block.key()].append(block)
        return kinds


class CachingAllocator:
    """CUDA's caching allocator's choice of blocks, replayed over an allocation log (one
    stream, the default settings: no ``max_split_size``, no expandable segments).
    What ``max_memory_allocated`` counts is the blocks handed out, and a block may be
    larger than asked: a request for more than 1 MiB takes a cached free block whole
    unless more than 1 MiB would be left over. Requests of up to 1 MiB come from 2 MiB
    segments (split down to 512 bytes), up to 10 MiB from 20 MiB ones, larger ones
    from segments of their size rounded to 2 MiB; a request takes the smallest free
    block that fits; a freed block merges with free neighbours in its segment."""

    SMALL, SMALL_SEGMENT, LARGE_SEGMENT, LARGE, ROUND = 1 << 20, 2 << 20, 20 << 20, 10 << 20, 2 << 20

    def __init__(self) -> None:
        self.free: dict[bool, list] = {True: [], False: []}  # small pool? -> [(size, seg, at)]
        self.pools: list[bool] = []  # seg -> its pool
        self.blocks: list[dict[int, list]] = []  # seg -> at -> [size, in use]
        self.ends: list[dict[int, int]] = []  # seg -> a block's end -> its start
        self.given: dict[int, tuple[int, int]] = {}  # id(Block) -> (seg, at)
        self.allocated = self.peak = 0
        self.replayed = self.peak_at = 0  # events replayed; how many at the peak

    def _segment_size(self, size: int) -> int:
        if size <= self.SMALL:
            return self.SMALL_SEGMENT
        if size < self.LARGE:
            return self.LARGE_SEGMENT
        return -(-size // self.ROUND) * self.ROUND

    def _put(self, seg: int, at: int, size: int, used: bool) -> None:
        self.blocks[seg][at] = [size, used]
        self.ends[seg][at + size] = at
        if not used:
            bisect.insort(self.free[self.pools[seg]], (size, seg, at))

    def _take(self, seg: int, at: int) -> int:
        """Removes the block at ``at`` (free or not); its size."""
        size, used = self.blocks[seg].pop(at)
        del self.ends[seg][at + size]
        if not used:
            self.free[self.pools[seg]].remove((size, seg, at))
        return size

    def allocate(self, key: int, size: int) -> None:
        size = block_bytes(size)
        small = size <= self.SMALL
        pool = self.free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            have, seg, at = pool[i]
            self._take(seg, at)
        else:  # a new segment (cudaMalloc)
            have, seg, at = self._segment_size(size), len(self.pools), 0
            self.pools.append(small)
            self.blocks.append({})
            self.ends.append({})
        left = have - size
        if (left >= BLOCK) if small else (left > self.SMALL):  # split: the rest stays free
            self._put(seg, at + size, left, used=False)
        else:
            size = have  # the whole block, counted whole
        self._put(seg, at, size, used=True)
        self.given[key] = (seg, at)
        self.allocated += size
        if self.allocated > self.peak:
            self.peak, self.peak_at = self.allocated, self.replayed + 1

    def release(self, key: int) -> None:
        seg, at = self.given.pop(key)
        size = self._take(seg, at)
        self.allocated -= size
        after = self.blocks[seg].get(at + size)
        if after is not None and not after[1]:  # merged with the free block after it
            size += self._take(seg, at + size)
        before = self.ends[seg].get(at)
        if before is not None and not self.blocks[seg][before][1]:  # and the one before
            size += self._take(seg, before)
            at = before
        self._put(seg, at, size, used=False)

    def replay(self, log: list, stop: Optional[int] = None) -> int:
        """The peak of allocated bytes over ``log`` (:attr:`Log.events`), or over its
        first ``stop`` events."""
        for sign, block in log[:stop]:
            if sign > 0:
                self.allocate(id(block), block.size)
            else:
                self.release(id(block))
            self.replayed += 1
        return self.peak

    def held(self) -> dict[int, int]:
        """id(Block) -> the size of the block it holds now."""
        return {key: self.blocks[seg][at][0] for key, (seg, at) in self.given.items()}


def allocator_peak(log: "Log") -> dict:
    """The allocator's peak over ``log``: its blocks, what they were asked for, and
    (phase, site, op, dtype) -> [bytes held, bytes asked] at that moment."""
    first = CachingAllocator()
    first.replay(log.events)
    at_peak = CachingAllocator()
    at_peak.replay(log.events, stop=first.peak_at)
    held = at_peak.held()
    blocks = {id(b): b for sign, b in log.events[:first.peak_at] if sign > 0 and id(b) in held}
    kinds: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for key, size in held.items():
        kinds[blocks[key].key()][0] += size
        kinds[blocks[key].key()][1] += blocks[key].size
    return {"bytes": first.peak, "asked": sum(b.size for b in blocks.values()),
            "kinds": dict(kinds)}


def requests_apart(a: "Log", b: "Log", names: tuple[str, str] = ("a", "b")) -> list[list]:
    """Where two logs' requests part: the allocations of one that the other does not
    make, and those both make at different sizes, matched in order by where they were
    made (phase, site, operator, dtype). Two logs with none hand the caching allocator
    the same requests in the same order, so it packs them alike and their blocks differ
    only by the sizes that differ; where one makes a request the other does not, what
    follows may be packed otherwise (``docs/performance.md``, session 29: a QKV-sized
    gradient in vanilla's backward moved three of Adam's states into larger blocks).
    [[side ("<a's name> only", "<b's name> only", "sizes differ"), phase, site, op,
    dtype, bytes (b's minus a's where sizes differ), requests]], largest first."""
    made = [[blk for sign, blk in log.events if sign > 0] for log in (a, b)]
    rows: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])

    def add(side: str, blk: Block, size: int) -> None:
        rows[(side, *blk.key())][0] += size
        rows[(side, *blk.key())][1] += 1

    # matched by kind and size; in each stretch where they part, a request of a kind
    # both make is paired with the other's next of that kind (a buffer grown by the
    # coefficients), the rest is one arm's own
    matcher = difflib.SequenceMatcher(None, *([(blk.key(), blk.size) for blk in side]
                                              for side in made), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        theirs: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        for blk in made[1][j1:j2]:
            theirs[blk.key()].append(blk)
        for blk in made[0][i1:i2]:
            other = theirs[blk.key()]
            if other:
                add("sizes differ", blk, other.popleft().size - blk.size)
            else:
                add(f"{names[0]} only", blk, blk.size)
        for blocks in theirs.values():
            for blk in blocks:
                add(f"{names[1]} only", blk, blk.size)
    out = [[*key, size, n] for key, (size, n) in rows.items()]
    out.sort(key=lambda r: (-abs(r[5]), r[:5]))
    return out


def _frame_site(frames: list[dict]) -> str:
    """The innermost kvtrain/megatron frame of a snapshot's stack (innermost first)."""
    named = (site(f.get("filename", ""), f.get("line"), f.get("name")) for f in frames)
    return next(filter(None, named), "?")


def read_snapshot(path: Path) -> Log:
    """The allocation log of a GPU run's ``torch.cuda.memory._dump_snapshot`` (recorded
    with ``_record_memory_history`` from before the arm's build: ``benchmarks/step.py
    --memory-history``): each ``alloc`` its requested size rounded as the allocator
    rounds it, freed at ``free_requested`` (when ``memory_allocated`` drops), named by
    its Python stack (phase "gpu": a trace does not know megatron's schedule)."""
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    traces = [t for t in snapshot.get("device_traces", []) if t]
    if len(traces) != 1:
        raise ValueError(f"{len(traces)} devices traced, one expected")
    log, live = Log(), {}
    for e in traces[0]:
        if e["action"] == "alloc":
            block = Block(block_bytes(e["size"]), _frame_site(e.get("frames", [])), "alloc",
                          "gpu", (e["size"],), "bytes")
            live[e["addr"]] = block
            log.count(+1, block, "an allocation")
        elif e["action"] == "free_requested" and e["addr"] in live:
            log.count(-1, live.pop(e["addr"]))
    return log
