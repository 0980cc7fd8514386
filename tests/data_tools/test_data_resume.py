"""SIGKILL during preprocess, then --resume: byte-identical to an
uninterrupted run; the killed run's workers die with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dt_helpers as h  # noqa: E402

from data_tools import readers  # noqa: E402
from data_tools.preprocess import preprocess  # noqa: E402

N_FILES = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    # Big enough that each shard takes a noticeable time with 2 workers.
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(N_FILES):
        h.write_jsonl(folder / f"part{i}.jsonl", h.synthetic_docs(4000, seed=10 + i))
    return folder


def _cmd(corpus, prefix, *extra):
    exe = os.path.join(os.path.dirname(sys.executable), "kvtrain")
    base = [exe] if os.path.exists(exe) else [sys.executable, "-m", "kvtrain.cli"]
    return base + ["data", "preprocess", "--input", str(corpus), "--tokenizer", h.tokenizer(),
                   "--output-prefix", str(prefix), "--workers", "2", "--chunk-mb", "0.25",
                   "--quiet", *extra]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # zombies are dead
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().split(")")[-1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids


def wait_for_a_half_written_shard(proc, out) -> None:
    """Until shard 0 of ``out`` is complete and a later shard is half-written."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "preprocess finished before it could be killed"
        assert time.monotonic() < deadline, "no complete shard after 120 s"
        names = os.listdir(out) if out.exists() else []
        if "c_00000_text_document.meta.json" in names and any(".tmp." in n for n in names):
            return
        time.sleep(0.005)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_sigkill_then_resume_is_byte_identical(corpus, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    preprocess(readers.discover([str(corpus)]), h.tokenizer(), str(ref / "c"), workers=2,
               progress=False, log=lambda m: None)

    proc = subprocess.Popen(_cmd(corpus, out / "c"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    workers: list[int] = []
    try:
        wait_for_a_half_written_shard(proc, out)
        workers = _children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        # The pool workers die with their parent (PR_SET_PDEATHSIG), not linger.
        assert workers
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    left = sorted(os.listdir(out))
    last = f"c_{N_FILES - 1:05d}_text_document"
    assert f"{last}.meta.json" not in left  # the unfinished shards are not complete
    assert f"{last}.idx" not in left

    resumed = subprocess.run(_cmd(corpus, out / "c", "--resume"), capture_output=True,
                             text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resume:" in resumed.stderr and f"of {N_FILES} shard(s) complete" in resumed.stderr
    assert not [n for n in os.listdir(out) if ".tmp." in n]  # stale temporaries removed
    expected = h.files_in(ref)
    assert len(expected) == 3 * N_FILES  # .bin, .idx, .meta.json per shard
    assert h.files_in(out) == expected

    # Resuming a finished run does nothing and changes nothing.
    again = subprocess.run(_cmd(corpus, out / "c", "--resume"), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0
    assert f"{N_FILES} of {N_FILES} shard(s) complete, 0 to do" in again.stderr
    assert h.files_in(out) == expected


def test_resume_redoes_shards_whose_input_changed(tmp_path):
    a = h.write_jsonl(tmp_path / "a.jsonl", h.synthetic_docs(10, seed=1))
    b = h.write_jsonl(tmp_path / "b.jsonl", h.synthetic_docs(10, seed=2))
    kw = dict(workers=0, progress=False, log=lambda m: None)
    preprocess(readers.discover([str(a), str(b)]), h.tokenizer(), str(tmp_path / "o"), **kw)
    h.write_jsonl(b, h.synthetic_docs(12, seed=3))
    res = preprocess(readers.discover([str(a), str(b)]), h.tokenizer(), str(tmp_path / "o"),
                     resume=True, **kw)
    assert res["resumed"] == 1
    assert h.shard_docs(res["outputs"][1]) == h.encode_expected(
        h.tokenizer(), h.synthetic_docs(12, seed=3))


def test_rerun_with_another_plan_removes_the_earlier_shards(tmp_path):
    """Fewer inputs, one shard after several, several after one: the earlier
    plan's shards go (one log line), so ``merge PREFIX`` reads only the new
    ones. The single shard of prefix c_00002, merge results and other names
    are left alone."""
    from data_tools.indexed import resolve_prefixes
    from data_tools.merge import merge

    files = [str(h.write_jsonl(tmp_path / f"in{i}.jsonl", h.synthetic_docs(5, seed=i)))
             for i in range(3)]
    out, logs = tmp_path / "s", []

    def run(inputs, prefix="c", **kw):
        logs.clear()
        res = preprocess(readers.discover(inputs), h.tokenizer(), str(out / prefix), workers=0,
                         progress=False, log=logs.append, **kw)
        return res, sorted(n for n in os.listdir(out) if n.startswith("c_"))

    run(files[:1], "c_00002")
    (out / "c_00001_text_document.bin.bak").write_bytes(b"x")
    (out / "cc_00001_text_document.idx").write_bytes(b"x")
    _, names = run(files[:2])
    assert "c_00002_text_document.idx" in names and not logs
    run(files)
    res, names = run(files[:2])
    assert logs == ["preprocess: removed 1 shard(s) of an earlier run that this one does not "
                    "write: c_00002_text_document"]
    assert not any(n.startswith("c_00002") for n in names)
    sources = resolve_prefixes(str(out / "c"), prefer_shards=True)
    assert sources == res["outputs"]
    assert merge(sources, str(tmp_path / "m"), log=lambda m: None)["documents"] == 10
    _, names = run(files, shards=1)
    assert "removed 2 shard(s)" in logs[0]
    assert [n for n in names if "_0000" in n] == ["c_00001_text_document.bin.bak"]
    res, names = run(files)
    assert logs[0].endswith(": c_text_document")
    assert [n for n in names if n.startswith("c_text")] == []
    merge(res["outputs"], str(out / "c_text_document"), log=lambda m: None)
    run(files[:2])  # a merge result is not a shard of this prefix
    assert logs[0].endswith(": c_00002_text_document")
    assert os.path.exists(out / "c_text_document.idx")
    assert os.path.exists(out / "cc_00001_text_document.idx")


def test_resume_redoes_shards_made_with_another_format(tmp_path):
    """jsonl under a .txt name, first run with the default (text: each line,
    JSON syntax and all, is a document), then with --format jsonl --resume."""
    import json

    src = tmp_path / "c.txt"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in h.line_docs()))
    kw = dict(workers=0, progress=False, log=lambda m: None)
    preprocess(readers.discover([str(src)]), h.tokenizer(), str(tmp_path / "o"), **kw)
    res = preprocess(readers.discover([str(src)], "jsonl"), h.tokenizer(), str(tmp_path / "o"),
                     resume=True, **kw)
    assert res["resumed"] == 0
    assert h.shard_docs(res["outputs"][0]) == h.encode_expected(h.tokenizer(), h.line_docs())
