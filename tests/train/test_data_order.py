"""The training data's order across a resume (kvtrain/data/order.py): megatron
builds its sample order for the number of samples a run asks for, so a run
extended past an epoch draws its samples in another order. A fingerprint of a
few drawn samples tells whether the dataset built now gives the samples the
checkpoint's run drew."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from kvtrain.config import load_config
from kvtrain.data.order import order_changed, order_fingerprint
from tests.train.conftest import VOCAB, tiny_config, write_config


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> str:
    from kvtrain.data.synthetic import write_shard

    # ~7.8k tokens: ~240 samples of 32
    return write_shard(tmp_path_factory.mktemp("order") / "a", _documents(0, 200, 20, 60))


def _documents(seed: int, count: int, low: int, high: int) -> list:
    rng = np.random.default_rng(seed)
    eod = VOCAB - 1
    return [np.append(rng.integers(0, eod, size=int(n)), eod).astype(np.int32)
            for n in rng.integers(low, high, size=count)]


def _train_set(single_rank, tmp_path, shard, samples):
    from kvtrain.data import build_datasets

    cfg = tiny_config(None, tmp_path / "cache", checkpoint={"save_interval": None})
    cfg["data"] = {"type": "gpt", "paths": [shard], "split": "100,0,0", "tokenizer": None,
                   "eod_id": VOCAB - 1, "num_workers": 0, "cache_dir": str(tmp_path / "cache")}
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    return build_datasets(cfg, str(tmp_path / "cache"), samples, 0).train


def test_an_extension_within_the_epoch_keeps_the_order(single_rank, tmp_path, shard):
    drawn = order_fingerprint(_train_set(single_rank, tmp_path, shard, 80), 80)
    assert [i for i, _ in drawn] == [0, 26, 53, 79]
    assert not order_changed(_train_set(single_rank, tmp_path, shard, 200), drawn)


def test_an_extension_past_the_epoch_is_seen(single_rank, tmp_path, shard):
    drawn = order_fingerprint(_train_set(single_rank, tmp_path, shard, 80), 80)
    assert order_changed(_train_set(single_rank, tmp_path, shard, 800), drawn)


def test_nothing_drawn_or_nothing_saved_is_no_change(single_rank, tmp_path, shard):
    data = _train_set(single_rank, tmp_path, shard, 80)
    assert order_fingerprint(data, 0) is None and order_fingerprint(None, 5) is None
    assert not order_changed(data, None) and not order_changed(data, [])
    assert order_changed(data, [[10_000, 0]])  # the index is past the dataset now


def test_a_shard_rewritten_under_its_name_gets_new_indices(single_rank, tmp_path):
    """megatron's index cache is keyed by the shard's path, not its content: another
    corpus written under the same name (a rerun of preprocess) was read through the
    first one's cached indices (an IndexError at its first sample, or silently the
    wrong samples). The rebuilt dataset is the one a fresh cache gives, and a resume
    from a checkpoint of the old corpus is told its order changed."""
    from kvtrain.data.synthetic import write_shard

    shard = write_shard(tmp_path / "data" / "a", _documents(0, 200, 20, 60))
    drawn = order_fingerprint(_train_set(single_rank, tmp_path / "run", shard, 20), 20)
    write_shard(shard, _documents(1, 30, 20, 60))  # ~1.2k tokens: ~36 samples of 32
    rebuilt = _train_set(single_rank, tmp_path / "run", shard, 20)
    fresh = _train_set(single_rank, tmp_path / "fresh", shard, 20)
    assert len(rebuilt) == len(fresh) < 200
    assert all(np.array_equal(rebuilt[i]["tokens"], fresh[i]["tokens"])
               for i in range(len(fresh)))
    assert order_changed(rebuilt, drawn)
    # a loader worker started by spawn gets the dataset pickled: its class is found
    assert len(pickle.loads(pickle.dumps(rebuilt))) == len(fresh)


def test_a_copy_of_the_same_sizes_and_times_gets_new_indices(single_rank, tmp_path):
    """The cache key held the shard files' sizes and times: another corpus of the same
    sizes, copied in with the old files' times (``rsync -t``, ``cp -p``), was read
    through the first one's cached indices, silently. Here: the same documents in
    reverse order (the same sizes, other sequence lengths at each index), the times
    put back. The key now holds a digest of the .idx (the indices follow from it)."""
    import os

    from kvtrain.data.synthetic import write_shard

    documents = _documents(2, 200, 20, 60)
    shard = write_shard(tmp_path / "data" / "a", documents)
    files = [f"{shard}{ext}" for ext in (".bin", ".idx")]
    stats = [os.stat(f) for f in files]
    drawn = order_fingerprint(_train_set(single_rank, tmp_path / "run", shard, 20), 20)
    write_shard(shard, documents[::-1])
    for f, st in zip(files, stats):
        assert os.stat(f).st_size == st.st_size
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    rebuilt = _train_set(single_rank, tmp_path / "run", shard, 20)
    fresh = _train_set(single_rank, tmp_path / "fresh", shard, 20)
    assert all(np.array_equal(rebuilt[i]["tokens"], fresh[i]["tokens"])
               for i in range(len(fresh)))
    assert order_changed(rebuilt, drawn)


def test_a_resume_says_when_the_data_order_changed(tmp_path, shard):
    """Through the trainer: a run extended within the epoch resumes quietly; extended
    past it, the resume says in one warning (and an event) that the order changed."""
    from tests.train.conftest import run_driver

    cfg = tiny_config(None, tmp_path / "cache", train={"max_steps": 10},
                      checkpoint={"save_interval": 5})
    cfg["data"] = {"type": "gpt", "paths": [shard], "split": "100,0,0", "tokenizer": None,
                   "eod_id": VOCAB - 1, "num_workers": 0, "cache_dir": str(tmp_path / "cache")}
    config = write_config(tmp_path / "c.yaml", cfg)
    logs = [tmp_path / f"job{i}.log" for i in range(3)]
    jobs = [{"config": str(config), "run_dir": str(tmp_path / "run"), "log": str(log),
             "overrides": [f"train.max_steps={steps}"]}
            for log, steps in zip(logs, (10, 25, 100))]  # 80, 200, 800 of ~240 samples
    jobs[2]["faults"] = {"stop_after": 26}  # the warning is said at the start: one step
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-3000:] + "".join(
        log.read_text()[-2000:] for log in logs if log.exists())
    text = [log.read_text() for log in logs]
    assert "resumed from" in text[1] and "order changed" not in text[1], text[1][-2000:]
    warning = [line for line in text[2].splitlines() if "order changed" in line]
    assert len(warning) == 1 and warning[0].startswith("kvtrain: warning: the training data's "
                                                       "order changed since the checkpoint")
    assert "from sample 200 on" in warning[0]
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert sum("order changed" in e.get("message", "") for e in events) == 1
