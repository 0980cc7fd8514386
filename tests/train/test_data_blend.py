"""A weighted blend of shards (``data.paths: [w1, prefix1, w2, prefix2, ...]``):
megatron's BlendedDataset draws each shard's share of the samples, and a run trains
on it from end to end."""

from __future__ import annotations

import numpy as np

from kvtrain.config import load_config
from tests.train.conftest import VOCAB, metrics, run, tiny_config, write_config

EOD = VOCAB - 1


def _shards(root) -> tuple[str, str]:
    """Two shards whose tokens do not overlap: A's below 100, B's from 200."""
    from kvtrain.data.synthetic import write_shard

    rng = np.random.default_rng(0)
    made = []
    for name, low in (("a", 0), ("b", 200)):
        docs = [np.append(rng.integers(low, low + 100, size=int(n)), EOD).astype(np.int32)
                for n in rng.integers(20, 60, size=300)]
        made.append(write_shard(root / name / "shard", docs))
    return made[0], made[1]


def _config(tmp_path, cache_dir, a: str, b: str, **train) -> dict:
    cfg = tiny_config(None, cache_dir, train=train, checkpoint={"save_interval": None})
    cfg["data"] = {"type": "gpt", "paths": [0.75, a, 0.25, b], "split": "98,2,0",
                   "tokenizer": None, "eod_id": EOD, "num_workers": 0,
                   "cache_dir": str(cache_dir)}
    return cfg


def test_each_shard_gives_its_weights_share_of_the_samples(single_rank, tmp_path, cache_dir):
    from kvtrain.data import build_datasets

    a, b = _shards(tmp_path)
    cfg = load_config(write_config(tmp_path / "c.yaml", _config(tmp_path, cache_dir, a, b)), [])
    train = build_datasets(cfg, str(cache_dir), 400, 0).train
    samples = [np.asarray(train[i]["tokens"]) for i in range(400)]
    text = [s[s != EOD] for s in samples]
    from_a = sum(bool((t < 100).all()) for t in text)
    from_b = sum(bool((t >= 200).all()) for t in text)
    assert from_a + from_b == 400  # a sample never mixes the shards
    assert abs(from_a - 300) <= 2, (from_a, from_b)


def test_a_run_trains_and_validates_on_a_blend(tmp_path, cache_dir):
    a, b = _shards(tmp_path)
    cfg = _config(tmp_path, cache_dir, a, b, max_steps=3, eval_interval=3, eval_iters=1)
    result = run(["train", str(write_config(tmp_path / "c.yaml", cfg)),
                  "--run-dir", str(tmp_path / "run")], timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert [r["iteration"] for r in metrics(tmp_path / "run")] == [1, 2, 3]
    assert [r["iteration"] for r in metrics(tmp_path / "run", "valid")] == [3]
