"""Item 10: damaged data shards are named in one line when the datasets are
built (before training), never found as a traceback at the first batch read;
``kvtrain data preprocess`` of an input without documents is an error."""

from __future__ import annotations

import math
import re
import os
import shutil
import struct
from pathlib import Path

import pytest

from kvtrain.config import ConfigError, load_config
from tests.train.conftest import run, run_driver, tiny_config, write_config


def _copy_shard(prefix: str, dest: Path) -> str:
    dest.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, dest / ("shard" + ext))
    return str(dest / "shard")


def _truncate(path: str, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def _damage(kind: str, prefix: str) -> str:
    """Damages the shard ``prefix``; returns the file the message must name."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if kind == "idx_truncated":
        _truncate(idx, Path(idx).stat().st_size - 20)
        return idx
    if kind == "idx_header_truncated":
        _truncate(idx, 20)
        return idx
    if kind == "bin_short":
        _truncate(bin_, Path(bin_).stat().st_size - 2)
        return bin_
    if kind == "bin_missing":
        Path(bin_).unlink()
        return bin_
    if kind == "idx_missing":
        Path(idx).unlink()
        return idx
    if kind == "bad_magic":
        with open(idx, "r+b") as f:
            f.write(b"NOTANIDX\x00")
        return idx
    if kind == "bad_version":
        with open(idx, "r+b") as f:
            f.seek(9)
            f.write(struct.pack("<Q", 7))
        return idx
    if kind == "bad_dtype":
        with open(idx, "r+b") as f:
            f.seek(17)
            f.write(b"\x63")
        return idx
    if kind in INDEX_CONTENTS:  # the right sizes, wrong contents: the O(1) checks pass
        _damage_index_contents(kind, idx)
        return idx
    raise ValueError(kind)


def _damage_index_contents(kind: str, idx: str) -> None:
    import numpy as np

    from data_tools.indexed import HEADER_SIZE, IndexedReader

    reader = IndexedReader(idx[:-len(".idx")])
    S, D = reader.sequence_count, reader.document_count
    data = np.memmap(idx, mode="r+", dtype=np.uint8)
    lengths = data[HEADER_SIZE:HEADER_SIZE + 4 * S].view(np.int32)
    pointers = data[HEADER_SIZE + 4 * S:HEADER_SIZE + 12 * S].view(np.int64)
    documents = data[HEADER_SIZE + 12 * S:HEADER_SIZE + 12 * S + 8 * D].view(np.int64)
    if kind == "pointers_off":  # all but the last: megatron read past the .bin mid-run
        pointers[:-1] += 10**9
    elif kind == "negative_length":
        lengths[0] = -lengths[0]
    else:  # documents_decrease
        documents[1], documents[2] = documents[2], documents[1]
    data.flush()


INDEX_CONTENTS = ["pointers_off", "negative_length", "documents_decrease"]
KINDS = ["idx_truncated", "idx_header_truncated", "bin_short", "bin_missing", "idx_missing",
         "bad_magic", "bad_version", "bad_dtype", *INDEX_CONTENTS]


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_shard_is_named_when_datasets_are_built(tmp_path, corpus, cache_dir, kind):
    from kvtrain.data import build_datasets

    prefix = _copy_shard(corpus.prefix, tmp_path / "data")
    named = _damage(kind, prefix)
    cfg = tiny_config(corpus, tmp_path / "cache")
    cfg["data"]["paths"] = [prefix]
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    with pytest.raises(ConfigError) as err:
        build_datasets(cfg, str(tmp_path / "cache"), 8, 0)
    message = str(err.value)
    assert named in message and "\n" not in message, message


def test_trainer_refuses_a_short_bin_in_one_line(tmp_path, corpus, cache_dir):
    prefix = _copy_shard(corpus.prefix, tmp_path / "data")
    _damage("bin_short", prefix)
    cfg = tiny_config(corpus, cache_dir)
    cfg["data"]["paths"] = [prefix]
    result = run(["train", str(write_config(tmp_path / "c.yaml", cfg)),
                  "--run-dir", str(tmp_path / "run")], timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and prefix + ".bin" in lines[0], result.stderr
    assert not (tmp_path / "run").exists()  # the folder this start made is gone again
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    again = run(["train", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "kept")],
                timeout=120)
    assert again.returncode == 2 and (tmp_path / "kept" / "notes.txt").read_text() == "mine"


def test_check_shard_accepts_a_sound_shard(corpus):
    from data_tools.indexed import check_shard

    assert check_shard(corpus.prefix) is None


def test_preprocess_without_documents_is_an_error(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data_tools"))
    import dt_helpers as h

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "   "}\n')
    out = tmp_path / "out" / "x"
    proc = h.kvtrain("data", "preprocess", "--input", str(empty), "--tokenizer", h.tokenizer(),
                     "--output-prefix", str(out), "--quiet", "--workers", "0", check=False)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    # the skipped records are reported as they are met; then one error line
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and str(empty) in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").glob("*")), list((tmp_path / "out").glob("*"))


# what only the training machine can check, at start: (section, key, value, the line's words)
MACHINE = {
    "more_loader_workers_than_cpus": ("data", "num_workers", 100000,
                                      "data.num_workers (100000) exceeds the {cpus} CPUs this rank may use"),
    "fp16_without_a_gpu": ("train", "precision", "fp16",
                           "train.precision fp16 needs a GPU (use fp32 or auto on CPU)"),
}


@pytest.mark.parametrize("case", sorted(MACHINE))
def test_what_this_machine_cannot_run_is_one_line(tmp_path, corpus, cache_dir, case):
    """data.num_workers beyond this machine's CPUs (a slip: 100000) started that many
    DataLoader processes per rank until the machine ran out of them; fp16 (a GPU's
    loss-scaled precision) on a CPU: one line at start, exit 2."""
    import os

    section, key, value, words = MACHINE[case]
    cfg = tiny_config(corpus, cache_dir)
    cfg[section][key] = value
    result = run(["train", str(write_config(tmp_path / "c.yaml", cfg)),
                  "--run-dir", str(tmp_path / "run")], timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"kvtrain: config error: "
                     f"{words.format(cpus=len(os.sched_getaffinity(0)))}" + (
                         ": DataLoader workers per rank, each a process"
                         if key == "num_workers" else "")], result.stderr[-3000:]


# case: (the shard's .meta.json fingerprint and top level made to say, the run's data
# section, the key the refusal names)
MADE_WITH = {
    "another_tokenizer": ({"tokenizer_sha256": "0" * 64}, {}, {}, "data.tokenizer"),
    "another_eod": ({"eod": 7}, {}, {"tokenizer": None, "eod_id": 9}, "data.eod_id"),
    "a_larger_vocabulary": ({}, {"vocab_size": 60_000}, {"tokenizer": None},
                            "model.vocab_size"),
}


@pytest.mark.parametrize("case", sorted(MADE_WITH))
def test_a_shard_made_with_another_tokenizer_is_refused(tmp_path, corpus, case):
    """A shard's .meta.json records the tokenizer (sha256), EOD id and vocabulary it
    was made with; the trainer read ids of one vocabulary as another's, or missed
    every document end, without a word."""
    import json

    from kvtrain.data import build_datasets

    if corpus.kind != "text":
        pytest.fail("the test corpus has no .meta.json: the data tools are missing")
    prefix = _copy_shard(corpus.prefix, tmp_path / "data")
    meta = json.loads(Path(corpus.prefix + ".meta.json").read_text())
    fingerprint, top, data, key = MADE_WITH[case]
    meta["fingerprint"].update(fingerprint)
    meta.update(top)
    Path(prefix + ".meta.json").write_text(json.dumps(meta))
    cfg = tiny_config(corpus, tmp_path / "cache")
    cfg["data"].update(paths=[prefix], **data)
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    with pytest.raises(ConfigError) as err:
        build_datasets(cfg, str(tmp_path / "cache"), 8, 0)
    message = str(err.value)
    assert prefix in message and key in message and "\n" not in message, message


def test_an_eod_id_other_than_the_tokenizers_is_refused(corpus):
    """data.eod_id applies without a tokenizer; with one, a different value was
    ignored silently (the user meant another end of document): one line."""
    from dataclasses import replace

    from kvtrain.data.tokenizer import load_tokenizer

    if corpus.tokenizer is None:
        pytest.fail("the test corpus has no tokenizer: the data tools are missing")
    cfg = load_config(None, ["data.type=gpt", f"data.paths=[{corpus.prefix}]",
                             f"data.tokenizer={corpus.tokenizer}",
                             "model.vocab_size=512"])
    eod = load_tokenizer(cfg.data, cfg.model).eod
    assert load_tokenizer(replace(cfg.data, eod_id=eod), cfg.model).eod == eod  # the same: fine
    with pytest.raises(ConfigError) as err:
        load_tokenizer(replace(cfg.data, eod_id=eod + 1), cfg.model)
    message = str(err.value)
    assert message.startswith(f"data.eod_id ({eod + 1})") and str(eod) in message, message


@pytest.mark.parametrize("data", ["gpt", "mock"])
def test_a_run_whose_sample_indices_exceed_memory_is_one_line(tmp_path, corpus, data):
    """train.max_steps 10**12 fits 64 bits, but megatron's indices of its 8 x 10**12
    sequences would not fit any machine's memory: one line naming the key. Before the
    fix megatron counted the epochs one loop turn at a time (hours), then failed to
    allocate them."""
    from kvtrain.data import build_datasets

    cfg = tiny_config(corpus if data == "gpt" else None, tmp_path / "cache",
                      train={"max_steps": 10**12})
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    with pytest.raises(ConfigError, match=r"train.max_steps asks for 8000000000000 training "
                                          r"sequences of 32 tokens: megatron's indices would "
                                          r"need \d+ GiB of memory \(\d+ GiB of sample indices"):
        build_datasets(cfg, str(tmp_path / "cache"), 8 * 10**12, 0)


def test_a_run_whose_document_indices_exceed_memory_is_one_line(tmp_path, corpus):
    """Short documents under long sequences: megatron's document index (an int32 per
    document and epoch) outgrows its sample indices. The check counted only those,
    so a run whose sample indices fit in memory went on to megatron's count of its
    epochs, one loop turn at a time, then failed to allocate them."""
    from kvtrain.data import build_datasets
    from kvtrain.data.datasets import _shard_size
    from kvtrain.data.index_memory import INDEX_BYTES_PER_SAMPLE

    documents, tokens = _shard_size(corpus.prefix)
    seq = 1 << max(4, math.ceil(math.log2(8 * tokens / documents)))  # 8+ documents a sequence
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    samples = memory // (2 * INDEX_BYTES_PER_SAMPLE)  # the sample indices: half the memory
    cfg = tiny_config(corpus, tmp_path / "cache", train={"seq_length": seq},
                      model={"max_position_embeddings": seq})
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    with pytest.raises(ConfigError, match=r"GiB of sample indices, 12 bytes a sequence; "
                                          r"\d+ GiB of document indices, 4 bytes a document "
                                          r"per epoch\), more than this machine's"):
        build_datasets(cfg, str(tmp_path / "cache"), samples, 0)
    assert not (tmp_path / "cache").exists()  # refused before any index is written


def test_a_run_whose_validation_indices_exceed_memory_is_one_line(tmp_path, corpus):
    """The validation part's indices (train.eval_iters x global batch sequences) are
    megatron's too: a run of few training steps but a huge train.eval_iters passed
    the check, which counted only the training part, and failed in megatron."""
    from kvtrain.data import build_datasets
    from kvtrain.data.index_memory import INDEX_BYTES_PER_SAMPLE

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    valid = memory // INDEX_BYTES_PER_SAMPLE + 1  # their sample indices alone: over memory
    cfg = tiny_config(corpus, tmp_path / "cache", data={"split": "50,50,0"})
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    with pytest.raises(ConfigError, match=rf"asks for 8 training sequences of 32 tokens and "
                                          rf"train.eval_iters for {valid} validation ones: "
                                          r"megatron's indices would need \d+ GiB"):
        build_datasets(cfg, str(tmp_path / "cache"), 8, valid)
    assert not (tmp_path / "cache").exists()  # refused before any index is written


def test_token_ids_beyond_the_vocabulary_are_one_line(tmp_path, corpus, cache_dir):
    """Shards of a larger vocabulary than model.vocab_size, with no .meta.json or
    tokenizer to say so (megatron's own shards): an IndexError traceback in the
    embedding at the first step (on a GPU a device-side assert). Now one line
    naming data.paths, the step and the id: the ids are clamped for the model, and
    the step is refused before its update."""
    prefix = _copy_shard(corpus.prefix, tmp_path / "data")  # .bin and .idx: no .meta.json
    cfg = tiny_config(corpus, cache_dir, model={"vocab_size": 64})
    cfg["data"].update(paths=[prefix], tokenizer=None, eod_id=None)
    config = str(write_config(tmp_path / "c.yaml", cfg))
    result = run(["train", config, "--run-dir", str(tmp_path / "run")], timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "kvtrain: config error: data.paths: a batch of step 1 holds token id "), lines
    assert "outside model.vocab_size (64)" in lines[0]
    # two ranks, each reading its share of the validation batches before training
    # (each found other ids): one line, the ranks' first finding, once for the node
    cfg["data"]["split"] = "50,50,0"  # validation batches enough for both ranks
    cfg["train"].update(eval_interval=3, eval_iters=1)
    config = str(write_config(tmp_path / "c2.yaml", cfg))
    both = run(["train", config, "--run-dir", str(tmp_path / "run2")], timeout=120, nproc=2)
    assert both.returncode != 0
    said = [line for line in both.stderr.splitlines() if line.startswith("kvtrain: ")]
    assert len(said) == 1 and "outside model.vocab_size (64)" in said[0], both.stderr[-3000:]
    assert not (tmp_path / "run2").exists()  # refused at the start: no new folder left


def test_token_ids_beyond_the_vocabulary_in_a_training_step_are_one_line_a_node(
        tmp_path, corpus, cache_dir):
    """Two ranks, each finding other ids in its training micro batches: each said its
    own line (or one died first and the other waited for it in the step's
    collectives). Now each notes what it found, clamps the ids so the step's
    collectives still run, and the step's all-reduce tells every rank: one line,
    the same on every rank (the highest id found), once for the node, no update."""
    prefix = _copy_shard(corpus.prefix, tmp_path / "data")
    cfg = tiny_config(corpus, cache_dir, model={"vocab_size": 64})
    cfg["data"].update(paths=[prefix], tokenizer=None, eod_id=None, split="100,0,0")
    config = str(write_config(tmp_path / "c.yaml", cfg))
    both = run(["train", config, "--run-dir", str(tmp_path / "run")], timeout=120, nproc=2)
    assert both.returncode != 0, both.stderr[-3000:]
    assert "kvtrain/train" not in both.stderr, both.stderr[-3000:]  # torchrun's own is there
    said = [line for line in both.stderr.splitlines() if line.startswith("kvtrain: ")]
    assert len(said) == 1 and said[0].startswith(
        "kvtrain: config error: data.paths: a batch of step 1 holds token id "), \
        both.stderr[-4000:]
    assert "outside model.vocab_size (64)" in said[0], said
    assert not list((tmp_path / "run" / "checkpoints").glob("iter_*"))


def test_a_loader_worker_killed_mid_run_is_one_line(tmp_path, corpus, cache_dir):
    """data.num_workers 2; the loader workers SIGKILLed at step 3 (as the OOM killer
    does): one line naming the data loader and data.num_workers (before: torch's
    RuntimeError traceback from inside megatron's schedule); the checkpoint of 2
    stays, and a start resumes from it."""
    cfg = tiny_config(corpus, cache_dir, train={"max_steps": 4},
                      checkpoint={"save_interval": 2})
    cfg["data"]["num_workers"] = 2
    config = str(write_config(tmp_path / "c.yaml", cfg))
    run_dir = str(tmp_path / "run")
    jobs = [{"config": config, "run_dir": run_dir, "expect": 2,
             "faults": {"kill_loader_workers_at": 3}},
            {"config": config, "run_dir": run_dir}]
    result = run_driver(jobs, tmp_path / "plan.json", timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("kvtrain: data error:")]
    assert len(lines) == 1, out[-4000:]
    assert re.fullmatch(r"kvtrain: data error: a data loader process ended: DataLoader worker "
                        r"\(pid\(?s?\)? [\d, ]+\) is killed by signal: Killed \(SIGKILL: what "
                        r"the kernel's out-of-memory killer sends, see dmesg\); data.num_workers "
                        r"is 2. The run stops here; a start resumes from the last checkpoint",
                        lines[0]), lines[0]
    assert "resumed from" in out and "iteration 2" in out, out[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "iter_0000004"


def test_only_torchs_loader_worker_errors_become_the_data_line():
    """``loader_deaths_named``: a worker that exited (not killed) is named without
    the out-of-memory hint; any other RuntimeError passes through untouched."""
    from kvtrain.data.loader import LoaderWorkerDied, loader_deaths_named

    with pytest.raises(LoaderWorkerDied) as e:
        with loader_deaths_named(4):
            raise RuntimeError("DataLoader worker (pid(s) 12, 13) exited unexpectedly")
    assert str(e.value) == ("a data loader process ended: DataLoader worker (pid(s) 12, 13) "
                            "exited unexpectedly; data.num_workers is 4. The run stops here; "
                            "a start resumes from the last checkpoint")
    with pytest.raises(RuntimeError, match="^CUDA out of memory$"):
        with loader_deaths_named(4):
            raise RuntimeError("CUDA out of memory")


def test_a_full_disk_as_the_index_cache_is_written_is_one_line_leaving_no_torn_file(
        tmp_path, corpus, mp1):
    """megatron writes a dataset's indices in place: a full disk (a quota) cut a file
    short, the build failed with pages of megatron's tracebacks, and what it had
    written stayed in the cache. Now one line, the build's files removed; with room
    again, the same build goes through."""
    from kvtrain.data import build_datasets
    from kvtrain.data.index_cache import LOCK
    from tests.hf.test_hf_refusals import small_files

    cache = tmp_path / "cache"
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config(corpus, cache)), [])
    with small_files(256):  # the set's description (its config, ~1 KB) is cut first
        with pytest.raises(ConfigError, match=r"^data.cache_dir: writing the dataset indices "
                                              rf"in {cache} failed: File too large; what the "
                                              r"build had written there is removed"):
            build_datasets(cfg, str(cache), 64, 16)
    assert [p.name for p in cache.iterdir()] == [LOCK]
    assert len(build_datasets(cfg, str(cache), 64, 16).train) >= 64


def test_an_index_cache_cut_short_is_built_again(tmp_path, corpus, mp1, capsys):
    """A set of index files whose .npy was cut short (a kill, a full disk before the
    fix above): megatron took the set for a cache hit and every start failed to map
    the short file. It is dropped, said in one line, and built again: the same
    samples as before."""
    from kvtrain.data import build_datasets

    cache = tmp_path / "cache"
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config(corpus, cache)), [])
    first = build_datasets(cfg, str(cache), 64, 16)
    expected = [first.train[i]["tokens"].tolist() for i in (0, 5, 63)]
    short = sorted(cache.glob("*-train-shuffle_index.npy"))[0]
    _truncate(str(short), short.stat().st_size - 8)
    capsys.readouterr()
    again = build_datasets(cfg, str(cache), 64, 16)
    assert [again.train[i]["tokens"].tolist() for i in (0, 5, 63)] == expected
    out = capsys.readouterr().out
    base = short.name[:-len("-shuffle_index.npy")]
    size = short.stat().st_size  # written again, whole
    assert f"kvtrain: data: dropped the damaged index cache {base} in {cache} ({short.name}: " \
           f"{size - 8} bytes, its header asks for {size}: a write cut short); it is built " \
           "again" in out, out


def test_a_read_only_index_cache_is_read(tmp_path, corpus, mp1):
    """A cache built once and shared read-only (a team's): read as it is, though no
    lock file can be made there (root only: a read-only bind mount)."""
    import subprocess

    from kvtrain.data import build_datasets

    built, shared = tmp_path / "built", tmp_path / "shared"
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config(corpus, built)), [])
    first = build_datasets(cfg, str(built), 64, 16)
    (built / ".kvtrain-index.lock").unlink()
    shared.mkdir()
    mount = subprocess.run(["mount", "--bind", str(built), str(shared)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mount.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(shared)], check=True)
        again = build_datasets(cfg, str(shared), 64, 16)
        assert again.train[7]["tokens"].tolist() == first.train[7]["tokens"].tolist()
        assert not (shared / ".kvtrain-index.lock").exists()
    finally:
        subprocess.run(["umount", "-l", str(shared)], capture_output=True)


def test_a_build_waits_for_another_runs_build_in_a_shared_cache(tmp_path, corpus, mp1, capsys):
    """Two runs sharing data.cache_dir take turns: one whose lock is held says it
    waits, then builds once the other lets go."""
    import subprocess
    import sys

    from kvtrain.data import build_datasets
    from kvtrain.data.index_cache import LOCK

    cache = tmp_path / "cache"
    cache.mkdir()
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config(corpus, cache)), [])
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(cache / LOCK)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(1.5)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        assert len(build_datasets(cfg, str(cache), 64, 16).train) >= 64
        assert holder.poll() is not None  # built only once the holder had let go
    finally:
        holder.kill()
        holder.wait()
    assert f"kvtrain: data: waiting for another run's index build in {cache}" in \
        capsys.readouterr().out
