"""``profile``: traces of chosen training steps (``kvtrain/train/profiling.py``).

One DP=2 launch runs the trainings (forked children of the test driver): a run
without profiling, the same run traced on both ranks (the losses bit-identical),
and a run traced on rank 1 alone, stopped inside its window and resumed. The
refusals are one line each, before any work."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from kvtrain.config import ConfigError, ProfileConfig, load_config
from kvtrain.train.profiling import Window, check_profile_start, window_of

from .conftest import by_iteration, metrics, run, run_driver, tiny_config, write_config

STEPS = 6


def traced_iterations(trace: Path) -> list[int]:
    """The ``kvtrain iteration N`` ranges a trace holds."""
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sorted({int(m.group(1)) for e in events
                   if (m := re.fullmatch(r"kvtrain iteration (\d+)", e.get("name", "")))})


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("profiling")
    base = dict(train={"max_steps": STEPS}, checkpoint={"save_interval": None})
    configs = {
        "plain": tiny_config(None, cache_dir, **base),
        "both": tiny_config(None, cache_dir, **base, profile={
            "start_step": 2, "num_steps": 2, "ranks": [0, 1], "record_shapes": True,
            "with_stack": True}),
        "rank1": tiny_config(None, cache_dir, **base, profile={
            "start_step": 2, "num_steps": 4, "ranks": [1]}),
    }
    paths = {name: write_config(root / f"{name}.yaml", cfg) for name, cfg in configs.items()}
    jobs = [{"config": str(paths[name]), "run_dir": str(root / name), "faults": faults}
            for name, faults in [
                ("plain", {}), ("both", {}),
                ("rank1", {"stop_after": 3}),  # a stop inside the window 2-5
                ("rank1", {}),  # the resume traces the rest: 4-5
            ]]
    result = run_driver(jobs, root / "plan.json", nproc=2, timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root, result.stdout


def test_a_window_is_traced_on_each_rank_and_changes_nothing(runs):
    runs, log = runs
    folder = runs / "both" / "profile" / "iter_0000002-0000003"
    assert files(folder) == ["rank00000.ops.txt", "rank00000.trace.json.gz",
                             "rank00001.ops.txt", "rank00001.trace.json.gz"]  # no temporaries
    for rank in (0, 1):
        # the warm-up step (1) runs under the profiler but is not in the trace
        assert traced_iterations(folder / f"rank{rank:05d}.trace.json.gz") == [2, 3]
        table = (folder / f"rank{rank:05d}.ops.txt").read_text()
        assert "Self CPU" in table and "aten::mm" in table
    assert f"kvtrain: profile: tracing iterations 2-3 on rank(s) 0, 1 into {folder}" in log
    assert f"kvtrain: profile: iterations 2-3 traced into {folder}" in log
    events = [e for e in metrics(runs / "both", "event") if "profile" in e.get("message", "")]
    assert [(e["iteration"], e["message"]) for e in events] == [
        (3, f"profile: iterations 2-3 traced into {folder}")]
    plain, traced = by_iteration(metrics(runs / "plain")), by_iteration(metrics(runs / "both"))
    assert sorted(traced) == list(range(1, STEPS + 1))
    for it in plain:
        assert traced[it]["lm_loss"] == plain[it]["lm_loss"], it
        assert traced[it]["grad_norm"] == plain[it]["grad_norm"], it
    assert not (runs / "plain" / "profile").exists()


def test_a_stop_inside_the_window_writes_what_was_traced_and_the_resume_the_rest(runs):
    runs, log = runs
    first = runs / "rank1" / "profile" / "iter_0000002-0000005"
    assert files(first) == ["rank00001.ops.txt", "rank00001.trace.json.gz"]  # rank 1 only
    assert traced_iterations(first / "rank00001.trace.json.gz") == [2, 3]
    second = runs / "rank1" / "profile" / "iter_0000004-0000005"
    assert traced_iterations(second / "rank00001.trace.json.gz") == [4, 5]
    assert ("kvtrain: profile: tracing iterations 4-5 (2-3 ran before this start) on "
            f"rank(s) 1 into {second}") in log
    # rank 0 traces nothing but says what rank 1 traced, in the log and the records
    events = [e["message"] for e in metrics(runs / "rank1", "event") if "profile" in e["message"]]
    assert events == [f"profile: iterations 2-3 traced into {first}",
                      f"profile: iterations 4-5 traced into {second}"]


@pytest.mark.parametrize("begin, total, window, line", [
    (1, 10, Window(3, 4, 1), "tracing iterations 3-4"),
    (3, 10, Window(3, 4, 0), "tracing iterations 3-4"),  # no step before it in this start
    (4, 10, Window(4, 4, 0), "tracing iteration 4 (3 ran before this start)"),
    (5, 10, None, "iterations 3-4 ran before this start (resumed at iteration 4): not traced"),
    (1, 3, Window(3, 3, 1), "tracing iteration 3 (the run ends at 3)"),
])
def test_the_window_of_a_start(begin, total, window, line):
    cfg = ProfileConfig(start_step=3, num_steps=2)
    assert window_of(cfg, begin, total) == (window, line)


@pytest.mark.parametrize("sets, world, error", [
    (["profile.num_steps=3"], None,
     "profile.num_steps is set but profile.start_step is null: no step is traced "
     "(set profile.start_step)"),
    (["profile.memory_history=true"], None, "profile.memory_history is set but"),
    (["profile.start_step=0"], None,
     "profile.start_step and profile.num_steps must be >= 1, got 0 and 2"),
    (["profile.start_step=1", "profile.num_steps=0"], None, "must be >= 1, got 1 and 0"),
    (["profile.start_step=1", "profile.ranks=[]"], None, "profile.ranks is empty"),
    (["profile.start_step=1", "profile.ranks=[0,0]"], None,
     "profile.ranks must be distinct ranks >= 0, got [0, 0]"),
    (["profile.start_step=1", "profile.ranks=[-1]"], None, "distinct ranks >= 0"),
    (["profile.start_step=1", "profile.ranks=[0,2]"], 2,
     "profile.ranks: rank 2 is not one of this run's 2 (0-1)"),
])
def test_profile_settings_that_trace_nothing_or_no_rank_are_refused(sets, world, error):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets, world_size=world)
    assert error in str(e.value)


def test_what_a_start_cannot_trace_is_refused(tmp_path):
    cfg = ProfileConfig(start_step=5, memory_history=True)
    with pytest.raises(ConfigError, match=r"^profile.start_step \(5\) is after the run's last "
                                          r"step \(4\): nothing would be traced$"):
        check_profile_start(cfg, "cuda", 4, tmp_path, 0)
    with pytest.raises(ConfigError, match="^profile.memory_history records the CUDA caching "
                                          "allocator: this run is on the cpu"):
        check_profile_start(cfg, "cpu", 10, tmp_path, 0)
    (tmp_path / "file").write_text("")
    cfg = ProfileConfig(start_step=1, dir=str(tmp_path / "file" / "traces"))
    check_profile_start(cfg, "cpu", 10, tmp_path, 1)  # rank 1 does not trace: makes nothing
    with pytest.raises(ConfigError, match="^profile.dir "):
        check_profile_start(cfg, "cpu", 10, tmp_path, 0)


def test_a_cuda_history_on_the_cpu_is_one_line_and_leaves_no_run_folder(tmp_path, cache_dir):
    config = write_config(tmp_path / "c.yaml", tiny_config(None, cache_dir, profile={
        "start_step": 1, "memory_history": True}))
    result = run(["train", str(config), "--run-dir", str(tmp_path / "run")])
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0].endswith("profile.memory_history records the CUDA caching allocator: "
                             "this run is on the cpu (set it false)"), lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
def test_on_a_gpu_the_trace_has_kernels_and_the_allocator_history_is_written(tmp_path,
                                                                           cache_dir):
    """The lent GPU: CUDA kernels in the trace, the table by device time, and the
    caching allocator's snapshot with the traced steps' history."""
    import pickle

    config = write_config(tmp_path / "c.yaml", tiny_config(None, cache_dir, train={
        "max_steps": 4}, checkpoint={"save_interval": None}, profile={
        "start_step": 2, "num_steps": 2, "memory_history": True}))
    result = run(["train", str(config), "--run-dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = tmp_path / "run" / "profile" / "iter_0000002-0000003"
    assert files(folder) == ["rank00000.memory.pickle", "rank00000.ops.txt",
                             "rank00000.trace.json.gz"]
    events = json.loads(gzip.decompress((folder / "rank00000.trace.json.gz").read_bytes()))
    assert any(e.get("cat") == "kernel" for e in events["traceEvents"])
    assert "Self CUDA" in (folder / "rank00000.ops.txt").read_text()
    snapshot = pickle.loads((folder / "rank00000.memory.pickle").read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"])


def test_a_trace_that_cannot_be_written_is_a_warning_and_leaves_no_part(tmp_path, capsys):
    """A full disk while a trace is written: one warning line, the training goes on,
    and neither the file nor its temporary is left half-written."""
    from kvtrain.train.profiling import StepProfiler

    profiler = StepProfiler(ProfileConfig(start_step=1), Window(1, 1, 0), tmp_path, 0, "cpu")
    (tmp_path / "iter_0000001-0000001").mkdir()

    def full_disk(tmp: str) -> None:
        Path(tmp).write_text("half a trace")
        raise OSError(28, "No space left on device")

    profiler._write("rank00000.trace.json.gz", full_disk)
    out = capsys.readouterr().out
    assert out == ("kvtrain: warning: rank 0: cannot write the profile's "
                   f"{tmp_path / 'iter_0000001-0000001' / 'rank00000.trace.json.gz'}: "
                   "[Errno 28] No space left on device\n")
    assert files(tmp_path / "iter_0000001-0000001") == []


def test_the_profilers_own_failure_is_a_warning(tmp_path, capsys):
    """torch's parse of the traced events can fail (with_stack at a stop inside the
    window: torch 2.13's UnicodeDecodeError, which ended the run after its save): the
    table is left out with a warning naming the error."""
    from kvtrain.train.profiling import StepProfiler

    profiler = StepProfiler(ProfileConfig(start_step=1), Window(1, 1, 0), tmp_path, 1, "cpu")
    (tmp_path / "iter_0000001-0000001").mkdir()

    def parse(tmp: str) -> None:
        raise UnicodeDecodeError("utf-8", b"\xef", 0, 1, "invalid continuation byte")

    profiler._write("rank00001.ops.txt", parse)
    out = capsys.readouterr().out
    assert out.startswith("kvtrain: warning: rank 1: cannot write the profile's ")
    assert "rank00001.ops.txt: UnicodeDecodeError: 'utf-8' codec can't decode" in out
    assert files(tmp_path / "iter_0000001-0000001") == []
