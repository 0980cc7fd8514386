"""Checkpoint faults (issue 10, items 2 and 3): a damaged or missing ``latest``,
damaged checkpoints, ``resume: none`` on a folder with checkpoints, a save that
fails on a full disk, and the history a fallback must not destroy.

One run of 6 steps saves at 2, 4 and 6 (one process); every scenario copies
its run folder, damages the copy and resumes it, all in ONE more launch of the
test driver (a forked child per job). The runs use mock data: their losses
are deterministic, so a resumed run's losses must equal the uninterrupted
run's bit for bit. The pure parts (the manifest, the choice of candidates,
the reason of a failed save) are tested in-process, without megatron.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtrain.config import ConfigError
from tests.train.conftest import by_iteration, metrics, run, run_driver, tiny_config, write_config

STEPS = 6
CK = "checkpoints"


def _it(n: int) -> str:
    return f"iter_{n:07d}"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.distcp"))[0]


# scenario -> (damage of the copied run folder, overrides, expected exit code)
SCENARIOS = {
    "latest-empty": (lambda d: (d / CK / "latest").write_text(""), [], 0),
    "latest-deleted": (lambda d: (d / CK / "latest").unlink(), [], 0),
    "latest-not-utf8": (lambda d: (d / CK / "latest").write_bytes(b"\xff\xfe\x00iter"), [], 0),
    "latest-names-missing": (lambda d: (d / CK / "latest").write_text(_it(9) + "\n"), [], 0),
    "shard-truncated": (lambda d: _truncate(_shard(d / CK / _it(6))), [], 0),
    "common-truncated": (lambda d: _truncate(d / CK / _it(6) / "common.pt"), [], 0),
    "metadata-truncated": (lambda d: _truncate(d / CK / _it(6) / ".metadata"), [], 0),
    "shard-deleted": (lambda d: _shard(d / CK / _it(6)).unlink(), [], 0),
    # not verified: megatron's load fails, and the run still falls back
    "unverified-shard-truncated": (lambda d: _truncate(_shard(d / CK / _it(6))),
                                   ["checkpoint.verify=none"], 0),
    "rollback": (lambda d: (d / CK / "latest").write_text(_it(2) + "\n"),
                 ["checkpoint.keep_last=1"], 0),
    "all-damaged": (lambda d: [_truncate(_shard(d / CK / _it(i))) for i in (2, 4, 6)], [], 2),
    "resume-none": (lambda d: None, ["checkpoint.resume=none"], 2),
    # saved by an older kvtrain, before markers held a file manifest
    "no-manifest": (lambda d: _drop_manifest(d / CK / _it(6)), [], 0),
}
TRACKER_FAULTS = ["latest-empty", "latest-deleted", "latest-not-utf8", "latest-names-missing"]
DAMAGED = {"shard-truncated": "__0_0.distcp", "common-truncated": "common.pt",
           "metadata-truncated": ".metadata", "shard-deleted": "__0_0.distcp",
           "unverified-shard-truncated": "could not be loaded"}


def _drop_manifest(ckpt: Path) -> None:
    marker = ckpt / "kvtrain_checkpoint.json"
    info = json.loads(marker.read_text())
    del info["manifest"]
    marker.write_text(json.dumps(info))


def _mount_tmpfs(where: Path, kib: int) -> bool:
    """A small filesystem to fill (root only; False where it cannot be mounted)."""
    where.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)],
                          capture_output=True)
    return done.returncode == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("checkpoint_faults")
    config = write_config(root / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": STEPS},
        checkpoint={"save_interval": 2, "keep_last": None}))
    base = root / "base"
    first = run_driver([{"config": str(config), "run_dir": str(base)}], root / "base.json")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    jobs = []
    for name, (damage, overrides, code) in SCENARIOS.items():
        shutil.copytree(base, root / name)
        damage(root / name)
        jobs.append({"config": str(config), "run_dir": str(root / name), "overrides": overrides,
                     "expect": code, "log": str(root / f"{name}.log")})
    # disk full: room for one checkpoint, not two; the save at 4 fails
    size_kib = sum(f.stat().st_size for f in (base / CK / _it(2)).iterdir()) // 1024
    mounted = _mount_tmpfs(root / "tmpfs", size_kib * 3 // 2)
    if mounted:
        jobs.append({"config": str(config), "run_dir": str(root / "disk-full"), "expect": 2,
                     "overrides": [f"checkpoint.dir={root / 'tmpfs' / CK}"],
                     "log": str(root / "disk-full.log")})
    second = run_driver(jobs, root / "resume.json")
    yield root, second, mounted
    if mounted:
        subprocess.run(["umount", "-l", str(root / "tmpfs")], capture_output=True)


def _log(root: Path, name: str) -> str:
    return (root / f"{name}.log").read_text()


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def _check_exit(runs, name: str) -> str:
    root, result, _ = runs
    text = _log(root, name)
    assert result.job_codes[str(root / name)] == [SCENARIOS[name][2]], text[-1200:]
    assert "Traceback" not in text, text[-1200:]
    return text


def _losses(run_dir: Path) -> dict:
    return {i: (r["lm_loss"], r["grad_norm"]) for i, r in by_iteration(metrics(run_dir)).items()}


@pytest.mark.parametrize("name", TRACKER_FAULTS)
def test_bad_latest_resumes_newest_intact_checkpoint(runs, name):
    root = runs[0]
    text = _check_exit(runs, name)
    warnings = _lines(text, "kvtrain: warning:")
    assert len(warnings) == 1 and "latest" in warnings[0], text[-1200:]
    assert f"resumed from {root / name / CK / _it(6)} at iteration 6" in text
    assert sorted(p.name for p in (root / name / CK).glob("iter_*")) == [_it(2), _it(4), _it(6)]
    assert metrics(root / name) == metrics(root / "base")  # nothing trained again
    events = [e["message"] for e in metrics(root / name, kind="event")]
    assert any("latest" in e for e in events), events  # the warning is recorded too


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_damaged_checkpoint_falls_back_to_the_previous_one(runs, name):
    root = runs[0]
    text = _check_exit(runs, name)
    warnings = _lines(text, "kvtrain: warning:")
    damaged = [w for w in warnings if DAMAGED[name] in w and _it(6) in w]
    assert len(damaged) == 1, text[-1200:]
    assert f"resumed from {root / name / CK / _it(4)} at iteration 4" in text
    base, resumed = _losses(root / "base"), _losses(root / name)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == base  # bit-exact: 5 and 6 trained again from the checkpoint at 4
    # the damaged checkpoint is set aside (kept as it was), not deleted or overwritten
    (kept,) = (root / name / CK).glob(f"abandoned-*/{_it(6)}")
    assert (kept / "kvtrain_checkpoint.json").exists()
    assert (root / name / CK / "latest").read_text().strip() == _it(6)


def test_a_checkpoint_without_a_manifest_resumes_with_a_warning(runs):
    """A checkpoint an older kvtrain saved (its marker has no file manifest) cannot be
    verified: it is loaded, and the run says so once, on stdout and in its events."""
    root = runs[0]
    text = _check_exit(runs, "no-manifest")
    warnings = _lines(text, "kvtrain: warning:")
    assert warnings == [f"kvtrain: warning: {root / 'no-manifest' / CK / _it(6)} was saved "
                        "without a file manifest (an older kvtrain): it cannot be verified"]
    assert f"resumed from {root / 'no-manifest' / CK / _it(6)} at iteration 6" in text
    events = [e["message"] for e in metrics(root / "no-manifest", kind="event")]
    assert any("without a file manifest" in e for e in events), events


def test_rollback_sets_newer_checkpoints_aside_not_deleted(runs):
    """``latest`` names iteration 2 (a user's rollback, or a fallback): the
    checkpoints at 4 and 6 belong to a history that was not loaded; keep_last=1
    must not delete them, nor the new saves at 4 and 6 replace them."""
    root = runs[0]
    text = _check_exit(runs, "rollback")
    assert f"resumed from {root / 'rollback' / CK / _it(2)} at iteration 2" in text
    assert _losses(root / "rollback") == _losses(root / "base")
    ck = root / "rollback" / CK
    assert sorted(p.name for p in ck.glob("iter_*")) == [_it(6)]  # keep_last=1
    for n in (4, 6):
        (kept,) = ck.glob(f"abandoned-*/{_it(n)}")
        for f in (root / "base" / CK / _it(n)).iterdir():
            assert (kept / f.name).read_bytes() == f.read_bytes()
    # the dropped metrics of that history are kept in a copy
    (copy,) = (root / "rollback").glob("metrics.jsonl.before-2-*")
    assert copy.read_text() == (root / "base" / "metrics.jsonl").read_text()
    assert any("set aside" in w for w in _lines(text, "kvtrain: warning:")), text[-1200:]


def test_every_checkpoint_damaged_stops_in_one_line(runs):
    root = runs[0]
    text = _check_exit(runs, "all-damaged")
    (error,) = _lines(text, "kvtrain: checkpoint error:")
    assert all(_it(n) in error for n in (2, 4, 6)), error
    assert sorted(p.name for p in (root / "all-damaged" / CK).glob("iter_*")) == \
        [_it(2), _it(4), _it(6)]
    assert (root / "all-damaged/metrics.jsonl").read_text() == \
        (root / "base/metrics.jsonl").read_text()


def test_resume_none_on_a_folder_with_checkpoints_is_refused(runs):
    root = runs[0]
    text = _check_exit(runs, "resume-none")
    (error,) = _lines(text, "kvtrain: checkpoint error:")
    assert "checkpoint.resume" in error and _it(6) in error, error
    assert (root / "resume-none/metrics.jsonl").read_text() == \
        (root / "base/metrics.jsonl").read_text()


def test_explicit_resume_of_a_damaged_checkpoint_fails_in_one_line(runs):
    """Through the real command line: exit 2, one short line, no fallback."""
    root = runs[0]
    run_dir = root / "explicit"
    shutil.copytree(root / "base", run_dir)
    _truncate(run_dir / CK / _it(6) / "common.pt")
    done = run(["train", str(root / "c.yaml"), "--run-dir", str(run_dir),
                "--set", f"checkpoint.resume={run_dir / CK / _it(6)}"])
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) < 3 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[-1].startswith("kvtrain: checkpoint error:") and "common.pt" in lines[-1]
    assert (run_dir / "metrics.jsonl").read_text() == (root / "base/metrics.jsonl").read_text()


def test_save_on_a_full_disk_says_why_and_keeps_latest(runs):
    root, result, mounted = runs
    if not mounted:
        pytest.skip("a tmpfs cannot be mounted here (needs root)")
    text = _log(root, "disk-full")
    assert result.job_codes[str(root / "disk-full")] == [2], text[-1200:]
    assert "Traceback" not in text, text[-1200:]
    (error,) = _lines(text, "kvtrain: checkpoint error:")
    assert "No space left on device" in error and _it(4) in error, error
    ck = root / "tmpfs" / CK
    assert (ck / "latest").read_text().strip() == _it(2)
    assert not list(ck.glob("*.incomplete"))
    assert (ck / _it(2) / "kvtrain_checkpoint.json").exists()


# ----------------------------------------------------------------------------- in-process units
def _fake_checkpoint(root: Path, n: int, marker: bool = True) -> Path:
    from kvtrain.train.integrity import MARKER, build_manifest

    path = root / _it(n)
    path.mkdir(parents=True)
    (path / "common.pt").write_bytes(b"c" * 100)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (path / "metadata.json").write_text("{}")
    if marker:
        (path / MARKER).write_text(json.dumps({"iteration": n,
                                               "manifest": build_manifest(path)}))
    return path


def test_manifest_verification_levels(tmp_path):
    from kvtrain.train.integrity import MARKER, check_checkpoint

    path = _fake_checkpoint(tmp_path, 4)
    assert check_checkpoint(path, "full").problem is None
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1  # bit rot: same size
    shard.write_bytes(bytes(data))
    assert check_checkpoint(path, "sizes").problem is None
    assert "__0_0.distcp" in check_checkpoint(path, "full").problem
    assert check_checkpoint(path, "none").problem is None
    _truncate(path / "common.pt")
    assert "common.pt is 50 bytes" in check_checkpoint(path, "sizes").problem
    (path / "common.pt").unlink()
    assert "common.pt is missing" in check_checkpoint(path, "sizes").problem
    (path / MARKER).write_bytes(b"{\xff")
    assert MARKER in check_checkpoint(path, "none").problem
    (path / MARKER).write_text(json.dumps({"iteration": 4}))  # an older kvtrain's marker
    older = check_checkpoint(path, "full")
    assert older.problem is None and "cannot be verified" in older.warning
    # checksums split over ranks: each part checks its own files, sizes everywhere
    fresh = _fake_checkpoint(tmp_path / "b", 2)
    assert all(check_checkpoint(fresh, "full", part=(r, 3)).problem is None for r in range(3))


@pytest.mark.parametrize("damage", ["no size", "no crc32", "no files", "files a list",
                                    "entry a number", "manifest a list", "size a string"])
def test_a_manifest_of_the_wrong_shape_is_a_problem(tmp_path, damage):
    """A marker that is valid JSON but whose manifest lost a key or changed shape
    is a damaged checkpoint (resume skips it with a warning), not a traceback."""
    from kvtrain.train.integrity import MARKER, check_checkpoint

    path = _fake_checkpoint(tmp_path, 4)
    info = json.loads((path / MARKER).read_text())
    manifest, entry = info["manifest"], info["manifest"]["files"]["common.pt"]
    {"no size": lambda: entry.pop("size"), "no crc32": lambda: entry.pop("crc32"),
     "no files": lambda: manifest.pop("files"),
     "files a list": lambda: manifest.update(files=["common.pt"]),
     "entry a number": lambda: manifest["files"].update({"common.pt": 100}),
     "manifest a list": lambda: info.update(manifest=[1]),
     "size a string": lambda: entry.update(size="100")}[damage]()
    (path / MARKER).write_text(json.dumps(info))
    for level in ("full", "sizes"):
        assert "damaged manifest" in check_checkpoint(path, level).problem


def test_resume_candidates(tmp_path):
    from kvtrain.train.integrity import plan_resume

    root = tmp_path / CK
    root.mkdir()
    assert plan_resume("auto", root).candidates == []  # a new run
    (root / "iter_0000008.incomplete").mkdir()  # half-written: not a candidate
    assert plan_resume("none", root).candidates == []
    for n in (2, 4, 6):
        _fake_checkpoint(root, n)
    newest_first = [root / _it(n) for n in (6, 4, 2)]
    for content, warns in ((None, True), (b"", True), (b"\xff\xfe", True),
                           (b"iter_0000009\n", True), (b"iter_0000006\n", False)):
        if content is None:
            (root / "latest").unlink(missing_ok=True)
        else:
            (root / "latest").write_bytes(content)
        plan = plan_resume("auto", root)
        assert plan.candidates == newest_first and bool(plan.warnings) == warns, plan
        assert not plan.explicit
    (root / "latest").unlink()
    (root / "latest").mkdir()  # the run trained to its first save, then failed there
    for resume in ("auto", "none", str(root / _it(4))):
        with pytest.raises(ConfigError, match=f"^{root / 'latest'} is not a file: a save names "
                                              "the checkpoint it completed there"):
            plan_resume(resume, root)
    (root / "latest").rmdir()
    (root / "latest").write_text(_it(2))  # a rollback: latest first, then newest first
    assert plan_resume("auto", root).candidates == [root / _it(n) for n in (2, 6, 4)]
    with pytest.raises(ConfigError, match="checkpoint.resume: none.*iter_0000006"):
        plan_resume("none", root)
    explicit = plan_resume(str(root / _it(4)), root)
    assert explicit.explicit and explicit.candidates == [root / _it(4)]
    assert plan_resume(str(root), root).candidates == [root / _it(2)]  # via its latest
    with pytest.raises(ConfigError, match="no such checkpoint"):
        plan_resume(str(tmp_path / "nope"), root)


def test_a_checkpoint_past_iteration_9999999_is_a_candidate(tmp_path):
    """iter_10000000 has 8 digits (checkpoint_name pads to 7): still a checkpoint
    folder, the newest, and a ``latest`` naming it is no problem."""
    from kvtrain.train.integrity import plan_resume

    root = tmp_path / CK
    old, new = _fake_checkpoint(root, 9_999_000), _fake_checkpoint(root, 10_000_000)
    (root / "latest").write_text(new.name + "\n")
    plan = plan_resume("auto", root)
    assert plan.warnings == [] and plan.candidates == [new, old], plan


def test_keep_last_keeps_the_newest_past_iteration_9999999(tmp_path):
    """keep_last counts checkpoints by iteration: iter_10000000 sorts before
    iter_9999000 by name, yet it is the newer one and stays."""
    from kvtrain.train.checkpoint import Checkpointer

    root = tmp_path / CK
    older, newer = _fake_checkpoint(root, 9_999_000), _fake_checkpoint(root, 10_000_000)
    saved = _fake_checkpoint(root, 10_001_000)
    ckpt = object.__new__(Checkpointer)  # _cleanup reads root and keep_last only
    ckpt.root, ckpt.keep_last = root, 2
    ckpt._cleanup(keep=saved)
    assert sorted(p.name for p in root.iterdir()) == [newer.name, saved.name], older


def test_save_failure_reason_finds_the_os_error(tmp_path):
    from kvtrain.train.integrity import save_failure_reason

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("unexpected pos 704 vs 598")
    except RuntimeError as e:
        assert "No space left on device" in save_failure_reason(e, tmp_path)
    wrapped = RuntimeError("Worker failure: [Errno 28] No space left on device")
    assert "No space left on device" in save_failure_reason(wrapped, tmp_path)
    # nothing in the chain and room on the disk: the exception's first line
    assert save_failure_reason(RuntimeError("boom\nmore"), tmp_path) == "RuntimeError: boom"


def test_a_save_failing_on_one_rank_stops_every_rank_with_its_reason(tmp_path, cache_dir):
    """Two ranks. A rank that fails after writing its shards (rank 1, EIO), and rank 0
    failing to move ``latest`` (a folder is in its way): every rank stops with the
    same line naming the failing rank and the OS error (said once), instead of the others
    waiting in a collective or reporting a closed connection; ``latest`` keeps
    naming the last complete checkpoint."""
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 4}, checkpoint={"save_interval": 2,
                                                             "keep_last": None}))
    # (made before the first save: a start refuses a `latest` that is no file)
    in_the_way = str(tmp_path / "in_the_way" / "checkpoints" / "latest")
    jobs = [{"config": str(config), "run_dir": str(tmp_path / "rank1"), "expect": 2,
             "faults": {"fail_in_save": [4, 1]}},
            {"config": str(config), "run_dir": str(tmp_path / "in_the_way"), "expect": 2,
             "faults": {"folder_at": [2, in_the_way]}}]
    result = run_driver(jobs, tmp_path / "plan.json", nproc=2, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    # (the two ranks share the pipe: their lines may run together)
    errors = re.findall(r"kvtrain: checkpoint error: (.*?) is unchanged", out)
    assert len(errors) == 2, out[-4000:]  # two jobs: the ranks agree, the node says it once
    rank1 = [e for e in errors if _it(4) in e]
    assert len(rank1) == 1 and all("rank 1: Input/output error" in e for e in rank1), errors
    rank0 = [e for e in errors if _it(2) in e]
    assert len(rank0) == 1 and all("rank 0: " in e and "Is a directory" in e for e in rank0)
    ck = tmp_path / "rank1" / CK
    assert (ck / "latest").read_text().strip() == _it(2) and not (ck / _it(4)).exists()
    assert not list(ck.glob("*.incomplete"))


def _can_bind_mount(folder: Path) -> bool:
    folder.mkdir(parents=True)
    if subprocess.run(["mount", "--bind", str(folder), str(folder)],
                      capture_output=True).returncode != 0:
        return False
    return subprocess.run(["umount", str(folder)], capture_output=True).returncode == 0


def test_a_read_only_checkpoint_folder_is_one_line_on_every_rank(tmp_path, cache_dir):
    """Two ranks, a checkpoint folder that turns read-only after the save at 2 (a
    read-only bind mount over it, by the fault): rank 0 failing to make
    ``iter_0000004.incomplete`` stops every rank with one line naming the OS error,
    instead of a traceback on rank 0 and the others waiting for it; ``latest``
    still names 2. A start whose checkpoint folder is there is refused in one
    line before anything runs."""
    ck = tmp_path / CK
    if not _can_bind_mount(ck):
        pytest.skip("no bind mount here (needs root)")
    try:
        config = write_config(tmp_path / "c.yaml", tiny_config(
            None, cache_dir, train={"max_steps": 4, "dist_timeout_minutes": 1},
            checkpoint={"save_interval": 2, "keep_last": None}))
        jobs = [{"config": str(config), "run_dir": str(tmp_path / name), "expect": 2,
                 "overrides": [f"checkpoint.dir={folder}"], **extra}
                for name, folder, extra in (
                    ("save", ck, {"faults": {"read_only_after_save": [2, str(ck)]}}),
                    ("start", ck / "new", {}))]
        result = run_driver(jobs, tmp_path / "plan.json", nproc=2, timeout=300)
    finally:
        subprocess.run(["umount", "-l", str(ck)], capture_output=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in out, out[-4000:]
    # (the two ranks share the pipe: their lines may run together)
    saves = re.findall(r"kvtrain: checkpoint error: (.*?) is unchanged", out)
    assert len(saves) == 1, out[-4000:]  # both ranks agree: said once
    assert all(f"saving the checkpoint of iteration 4 ({_it(4)}.incomplete) failed: rank 0: "
               "Read-only file system" in e for e in saves), saves
    assert (ck / "latest").read_text().strip() == _it(2)
    starts = re.findall(r"kvtrain: config error: checkpoint folder (\S+) cannot be written: "
                        r"Read-only file system", out)
    assert starts == [str(ck / "new")], out[-4000:]
    assert not (tmp_path / "start").exists()  # the refused start left no run folder
