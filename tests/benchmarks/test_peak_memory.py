"""``benchmarks/peak_memory.py``'s count: the caching allocator's, replayed on the CPU
(blocks rounded to 512 bytes; views, in-place results and a kernel's own copies not
allocations; a storage's ``resize_`` counted; what is alive at the peak). The script
through the trainer: ``test_tool_benchmarks.py -k peak_memory``."""

from __future__ import annotations

import os

import pytest
import torch

from ..scripts import REPO, load_script


@pytest.fixture(scope="module")
def peak():
    before = os.environ.get("TRITON_INTERPRET")
    try:
        return load_script(REPO / "benchmarks" / "peak_memory.py", "kvtrain_bench_peak_memory")
    finally:  # the script sets it for its own process: not for this one's later imports
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(scope="module")
def replay(peak):
    import benchmarks.allocator_replay as replay  # on the path: loading peak_memory put it

    return replay


def test_blocks_are_rounded_as_the_caching_allocator_rounds(peak):
    assert [peak.block_bytes(n) for n in (0, 1, 512, 513, 2 ** 20 + 1)] == [
        0, 512, 512, 1024, 2 ** 20 + 512]


def test_allocations_views_in_place_frees_and_resizes(peak):
    tracker = peak.Allocations()
    with tracker:
        a = torch.empty(1000, dtype=torch.uint8)  # 1,024 counted
        b = torch.zeros(3, 512, dtype=torch.uint8)  # 1,536
        view = a[10:].view(2, 495)  # a view: nothing
        b.add_(1)  # in place: nothing
        c = b.sum(0)  # [512] int64: 4,096
        assert tracker.log.total == 1024 + 1536 + 4096
        del a
        assert tracker.log.total == 1024 + 1536 + 4096  # the view keeps a's storage
        del view
        assert tracker.log.total == 1536 + 4096
        s = torch.empty(100, dtype=torch.uint8)  # 512
        s.untyped_storage().resize_(3000)  # 3,072 instead
        assert tracker.log.total == 1536 + 4096 + 3072
        s.untyped_storage().resize_(0)
        empty = torch.empty(0)
        assert tracker.log.total == 1536 + 4096
        del b, c, s, empty
    assert tracker.log.total == 0
    assert tracker.log.peak == 1024 + 1536 + 4096 + 3072 - 1024  # the resized one, a freed
    alive = [(op, [x.shape for x in blocks]) for (phase, site, op, dtype), blocks
             in sorted(tracker.log.at_peak().items())]
    assert sorted(alive) == [("aten.sum", [(512,)]), ("aten.zeros", [(3, 512)]),
                             ("resize_", [(3000,)])], alive
    assert torch.UntypedStorage.resize_ is tracker._resize  # unhooked on exit


def test_a_kernels_inside_and_outputs_of_its_inputs_are_not_allocations(peak):
    tracker = peak.Allocations()
    x = torch.ones(256)
    with tracker:
        tracker.launching = 1  # inside an interpreted Triton launch
        copy = x.clone()
        tracker.launching = 0
        same = x.mul_(2)  # returns its input
        assert tracker.log.total == 0 and tracker.log.peak == 0
        y = x * 2
        assert tracker.log.total == 1024
    assert same is x and copy is not None and y is not None


def test_the_arms_differences_at_their_peaks(peak):
    def arm(extra: int) -> object:
        tracker = peak.Allocations()
        with tracker:
            kept = [torch.empty(2048, dtype=torch.uint8)]
            tracker.phase = "backward"
            if extra:
                kept.append(torch.empty(extra, dtype=torch.uint8))
            kept.append(torch.empty(512, dtype=torch.uint8))
            del kept
        return tracker

    result = peak.compare({"vanilla": arm(0).log, "kv_shift": arm(1000).log}, top=5)
    assert [(e[0], e[2], e[4]) for e in result] == [("backward", "aten.empty", 1024)], result
    assert result[0][5] == "[512]" and result[0][6] in ("[1000], [512]", "[512], [1000]")


MiB = 2 ** 20


def _replay(replay, requests):
    """``requests``: ("a", name, bytes) | ("f", name); the allocator after them."""
    allocator, keys = replay.CachingAllocator(), {}
    for kind, name, *size in requests:
        if kind == "a":
            keys[name] = len(keys)
            allocator.allocate(keys[name], size[0])
        else:
            allocator.release(keys[name])
    return allocator


def test_the_allocator_hands_a_cached_block_whole_unless_over_1_mib_is_left(replay):
    # A 20 MiB segment cut in 3 + 17; the 3 MiB freed; 2 MiB asked: 1 MiB would be
    # left, not more than 1 MiB: the block is handed out (and counted) whole.
    a = _replay(replay, [("a", "x", 3 * MiB), ("a", "y", 17 * MiB), ("f", "x"),
                       ("a", "z", 2 * MiB)])
    assert a.allocated == 20 * MiB and len(a.pools) == 1
    # 1.5 MiB asked instead: 1.5 MiB left over, split.
    b = _replay(replay, [("a", "x", 3 * MiB), ("a", "y", 17 * MiB), ("f", "x"),
                       ("a", "z", 3 * MiB // 2)])
    assert b.allocated == 17 * MiB + 3 * MiB // 2
    # Small requests split down to 512 bytes, from 2 MiB segments of their own pool.
    c = _replay(replay, [("a", "s", 1000), ("a", "t", MiB), ("a", "t2", MiB - 1024),
                       ("a", "u", 512), ("a", "big", 12 * MiB + 1)])
    # (the large one: 12 MiB + 512 from a segment of 14 MiB, split)
    assert c.allocated == 2 * MiB + 512 + 12 * MiB + 512 and c.pools == [True, True, False]
    assert c.peak == c.allocated


def test_the_allocator_merges_freed_neighbours(replay):
    a = _replay(replay, [("a", "x", 4 * MiB), ("a", "y", 4 * MiB), ("a", "z", 4 * MiB),
                       ("f", "x"), ("f", "z"), ("f", "y")])
    assert a.allocated == 0 and a.peak == 12 * MiB
    assert list(a.blocks[0].items()) == [(0, [20 * MiB, False])]
    assert a.free == {True: [], False: [(20 * MiB, 0, 0)]}
    # The merged segment serves 18 MiB without a new one.
    a.allocate(99, 18 * MiB)
    assert len(a.pools) == 1 and a.allocated == 18 * MiB  # 2 MiB left over: split


def _snapshot(path, events):
    """A snapshot as ``torch.cuda.memory._dump_snapshot`` pickles it (the fields read)."""
    import pickle

    import importlib.util

    kvtrain, megatron = (os.path.dirname(importlib.util.find_spec(name).origin)
                         for name in ("kvtrain", "megatron.core"))  # where the run's frames are
    frames = {"mg": [{"filename": os.path.join(os.path.dirname(torch.__file__), "nn",
                                               "functional.py"), "line": 1, "name": "linear"},
                     {"filename": os.path.join(megatron, "tensor_parallel", "layers.py"),
                      "line": 7, "name": "forward"}],
              "kv": [{"filename": os.path.join(kvtrain, "backend", "cpu.py"), "line": 96,
                      "name": "wrapper"},
                     {"filename": os.path.join(kvtrain, "model", "qkv_rope.py"), "line": 150,
                      "name": "backward"}]}
    trace = [{"action": a, "addr": addr, "size": size, "stream": 0,
              "frames": frames.get(where, [])} for a, addr, size, where in events]
    with open(path, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [trace]}, f)


def test_a_gpu_snapshot_is_read_as_the_same_log(peak, tmp_path, capsys):
    common = [("segment_alloc", 0, 20 * MiB, ""), ("alloc", 1, 1000, "mg"),
              ("alloc", 2, 3 * MiB, "mg")]
    _snapshot(tmp_path / "v.pickle", [*common, ("free_requested", 2, 3 * MiB, ""),
                                      ("free_completed", 2, 3 * MiB, "")])
    _snapshot(tmp_path / "k.pickle", [*common, ("alloc", 3, 2 * MiB, "kv"),
                                      ("free_requested", 2, 3 * MiB, ""),
                                      ("free_requested", 3, 2 * MiB, ""),
                                      ("free_requested", 99, 5, "")])  # before the trace
    log = peak.read_snapshot(tmp_path / "k.pickle")
    assert (log.peak, log.total) == (1024 + 5 * MiB, 1024)
    out = tmp_path / "r.json"
    assert peak.main(["--snapshots", str(tmp_path / "v.pickle"), str(tmp_path / "k.pickle"),
                      "--json", str(out)]) == 0
    import json

    result = json.loads(out.read_text())
    assert result["differences"] == [["gpu", "kvtrain/model/qkv_rope.py:150 backward", "alloc",
                                      "bytes", 2 * MiB, "", f"[{2 * MiB}]"]], result
    assert result["arms"]["vanilla"]["allocator_peak_bytes"] == 1024 + 3 * MiB
    (tmp_path / "bad.pickle").write_bytes(b"not a pickle")
    assert peak.main(["--snapshots", str(tmp_path / "bad.pickle"), str(tmp_path / "k.pickle"),
                      "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.pickle" in err, err


def test_the_allocators_peak_names_the_blocks_held_larger_than_asked(replay):
    # A 20 MiB segment: x 3, y 15, 2 free; x freed; z (2.5) takes x's 3 whole, w (1.5)
    # the last 2 whole: 20 held for 19 asked, the peak (18 before).
    log = replay.Log()
    x, y, z, w = (replay.Block(int(n * MiB), site, "aten.empty", "backward", (), "torch.uint8")
                  for n, site in ((3, "a"), (15, "b"), (2.5, "c"), (1.5, "d")))
    for sign, block in ((+1, x), (+1, y), (-1, x), (+1, z), (+1, w)):
        log.count(sign, block)
    held = replay.allocator_peak(log)
    assert (held["bytes"], held["asked"], log.peak) == (20 * MiB, 19 * MiB, 19 * MiB)
    kinds = held["kinds"]
    assert kinds[("backward", "c", "aten.empty", "torch.uint8")] == [3 * MiB, 5 * MiB // 2]
    assert kinds[("backward", "d", "aten.empty", "torch.uint8")] == [2 * MiB, 3 * MiB // 2]
    assert ("backward", "a", "aten.empty", "torch.uint8") not in kinds  # freed


def test_where_two_arms_requests_part(replay):
    """Matched in order by kind and size: a request only one arm makes, one both make
    at other sizes (a buffer the coefficients grow), and the rest equal (frees not
    compared: the same program frees what it made)."""
    def log(requests):
        out = replay.Log()
        for phase, site, size in requests:
            out.count(+1, replay.Block(size, site, "aten.empty", phase, (), "torch.uint8"))
        return out

    common = [("forward", f"layer{i}", (i + 1) * 1024) for i in range(5)]
    vanilla = log([("build", "buffer", 8192), *common[:3], ("backward", "dqkv", 16384),
                   *common[3:]])
    shift = log([("build", "buffer", 9216), *common[:2], ("build", "coef", 512),
                 *common[2:]])
    rows = replay.requests_apart(vanilla, shift)
    assert rows == [["a only", "backward", "dqkv", "aten.empty", "torch.uint8", 16384, 1],
                    ["sizes differ", "build", "buffer", "aten.empty", "torch.uint8", 1024, 1],
                    ["b only", "build", "coef", "aten.empty", "torch.uint8", 512, 1]], rows
    assert replay.requests_apart(vanilla, vanilla) == []
