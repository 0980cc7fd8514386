"""A run folder that fills (a full disk, a quota) under a run whose checkpoints
are elsewhere: ``metrics.jsonl`` stopped the run with an OSError traceback and
a torn last line, and so did a print when the run's log is in the folder too
(SLURM's, under ``kvtrain submit``). Now the run trains on with one warning, the
file keeps whole lines, and the records the disk refused are written once there
is room (or named at the end); the log says where lines may be missing; a start
whose ``config.yaml`` cannot be written is one line.

The run folders are small tmpfs mounts (root only), filled by a file that a
fault deletes at a chosen step (``room_at``): four jobs in one driver launch.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.train.conftest import run_driver, tiny_config, write_config

PAGE = 4096
STEPS = 12


def _filled(where: Path, room_pages: int) -> bool:
    """A 64 KiB tmpfs at ``where`` with ``room_pages`` pages left (False: no mount here)."""
    where.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        return False
    (where / "filler").write_bytes(b"\0" * (64 * 1024 - room_pages * PAGE))
    return True


@pytest.fixture(scope="module")
def full(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("run_folder_faults")
    # lock + config.yaml + one page of records (about 8 of them)
    # "logged-here": its log is in the run folder too, as `kvtrain submit` puts SLURM's
    names = {"room-returns": 3, "never-room": 3, "no-room-for-the-config": 1, "logged-here": 4}
    mounted = [name for name, pages in names.items() if _filled(root / name, pages)]
    if len(mounted) < len(names):
        for name in mounted:
            subprocess.run(["umount", "-l", str(root / name)], capture_output=True)
        pytest.skip("a tmpfs cannot be mounted here (needs root)")
    config = write_config(root / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": STEPS},
        checkpoint={"save_interval": 6, "keep_last": None}))
    jobs = [{"config": str(config), "run_dir": str(root / name), "log": str(root / f"{name}.log"),
             "overrides": [f"checkpoint.dir={root / 'checkpoints' / name}"], **extra}
            for name, extra in (("room-returns", {"faults": {"room_at": [10, str(
                root / "room-returns" / "filler")]}}), ("never-room", {}),
                ("no-room-for-the-config", {"expect": 2}),
                ("logged-here", {"log": str(root / "logged-here" / "logs" / "out.log"),
                                 "faults": {"room_at": [10, str(root / "logged-here/filler")]}}))]
    (root / "logged-here" / "logs").mkdir()
    try:
        result = run_driver(jobs, root / "plan.json")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        logs = {name: (root / f"{name}.log") for name in names}
        logs["logged-here"] = root / "logged-here" / "logs" / "out.log"
        yield root, {name: path.read_text() for name, path in logs.items()}, {
            name: (root / name / "metrics.jsonl").read_bytes() for name in names
            if (root / name / "metrics.jsonl").exists()}
    finally:
        for name in names:
            subprocess.run(["umount", "-l", str(root / name)], capture_output=True)


def _records(data: bytes) -> list[dict]:
    assert data.endswith(b"\n"), data[-200:]  # whole lines only: none torn
    return [json.loads(line) for line in data.decode().splitlines()]


def _train_iterations(records: list[dict]) -> list[int]:
    return [r["iteration"] for r in records if r["kind"] == "train"]


def _warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("kvtrain: warning: metrics:")]


def test_records_refused_are_written_once_there_is_room(full):
    root, logs, files = full
    log = logs["room-returns"]
    assert "Traceback" not in log, log[-2000:]
    (warning,) = _warnings(log)
    assert warning.startswith(f"kvtrain: warning: metrics: writing to {root}/room-returns/"
                              "metrics.jsonl failed: No space left on device;"), warning
    records = _records(files["room-returns"])
    assert _train_iterations(records) == list(range(1, STEPS + 1))
    (wrote,) = [line for line in log.splitlines() if line.startswith("metrics: wrote the ")]
    assert "held since iteration" in wrote and f"{root}/room-returns/metrics.jsonl" in wrote
    assert (root / "checkpoints/room-returns/latest").read_text().strip() == f"iter_{STEPS:07d}"


def test_records_never_written_are_named_and_the_run_finishes(full):
    root, logs, files = full
    log = logs["never-room"]
    assert "Traceback" not in log, log[-2000:]
    first, last = _warnings(log)
    assert "failed: No space left on device; the run goes on" in first, first
    records = _records(files["never-room"])
    written = _train_iterations(records)
    assert written == list(range(1, len(written) + 1)) and 0 < len(written) < STEPS, written
    assert last == (f"kvtrain: warning: metrics: {STEPS - len(written)} records "
                    f"(iterations {written[-1] + 1}-{STEPS}) could not be written to "
                    f"{root}/never-room/metrics.jsonl: No space left on device"), last
    assert (root / "checkpoints/never-room/latest").read_text().strip() == f"iter_{STEPS:07d}"


def test_a_start_with_no_room_for_its_config_is_one_line(full):
    root, logs, _ = full
    lines = [line for line in logs["no-room-for-the-config"].splitlines()
             if line.startswith("kvtrain: ")]
    assert "Traceback" not in logs["no-room-for-the-config"]
    assert lines[-1] == (f"kvtrain: output error: writing {root}/no-room-for-the-config/"
                         "config.yaml failed: No space left on device; what was there before "
                         "is kept"), lines
    assert not (root / "checkpoints/no-room-for-the-config").exists()


def test_a_log_on_the_full_disk_does_not_end_the_run(full):
    """stdout and stderr in the run folder (SLURM's log under `kvtrain submit`): a
    print onto the full disk ended the run (OSError, exit 1, the last save lost)."""
    root, logs, files = full
    log = logs["logged-here"]
    assert "Traceback" not in log, log[-2000:]
    assert _train_iterations(_records(files["logged-here"])) == list(range(1, STEPS + 1))
    assert "kvtrain: warning: lines of this log may be missing here: writing it failed " \
        "(No space left on device)" in log, log[-3000:]
    assert f"kvtrain: finished at iteration {STEPS}/{STEPS}" in log, log[-2000:]
    assert (root / "checkpoints/logged-here/latest").read_text().strip() == f"iter_{STEPS:07d}"


def test_the_next_start_names_the_records_never_written(full):
    """The records lost to a disk full to the end were named in a log on that same
    disk, if anywhere; the next start resumed with no mark of the gap in
    metrics.jsonl. Now it warns and writes an event record naming the iterations."""
    root, _, files = full
    written = _train_iterations(_records(files["never-room"]))
    (root / "never-room" / "filler").unlink()  # room again
    log = root / "never-room-again.log"
    result = run_driver([{"config": str(root / "c.yaml"), "run_dir": str(root / "never-room"),
                          "log": str(log), "overrides": [
                              f"checkpoint.dir={root / 'checkpoints' / 'never-room'}"]}],
                        root / "again.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text, gap = log.read_text(), [written[-1] + 1, STEPS]
    assert (f"kvtrain: warning: metrics: {root}/never-room/metrics.jsonl has no train records "
            f"of iterations {gap[0]}-{gap[1]}, which were trained") in text, text[-3000:]
    assert f"kvtrain: nothing to do: iteration {STEPS} >= {STEPS} steps" in text, text[-3000:]
    records = _records((root / "never-room" / "metrics.jsonl").read_bytes())
    (event,) = [r for r in records if "missing_iterations" in r]
    assert (event["iteration"], event["missing_iterations"]) == (STEPS, [gap])
    assert _train_iterations(records) == written
