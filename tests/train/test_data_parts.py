"""How the data config's parts are built: a weighted blend of shards
(``data.paths: [w1, prefix1, w2, prefix2, ...]``), whose BlendedDataset draws each
shard's share of the samples and which a run trains on from end to end, and the
parts of ``data.split`` a run draws from."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrain.config import load_config
from tests.train.conftest import VOCAB, metrics, run, run_driver, tiny_config, write_config

EOD = VOCAB - 1


def _shards(root, n_docs=(300, 300)) -> tuple[str, str]:
    """Two shards whose tokens do not overlap: A's below 100, B's from 200."""
    from kvtrain.data.synthetic import write_shard

    rng = np.random.default_rng(0)
    made = []
    for name, low, size in (("a", 0, n_docs[0]), ("b", 200, n_docs[1])):
        docs = [np.append(rng.integers(low, low + 100, size=int(n)), EOD).astype(np.int32)
                for n in rng.integers(20, 60, size=size)]
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


def _from_a(dataset, n: int) -> int:
    """How many of the first n samples come from shard A (a sample is of one shard)."""
    text = [np.asarray(dataset[i]["tokens"]) for i in range(n)]
    text = [t[t != EOD] for t in text]
    assert all(bool((t < 100).all() or (t >= 200).all()) for t in text)
    return sum(bool((t < 100).all()) for t in text)


def test_unweighted_prefixes_blend_like_one_corpus(single_rank, tmp_path, cache_dir):
    """``data.paths: [a, b]`` without weights: each shard gives its share of the
    tokens, and, as with one shard, a run longer than one epoch of both and a
    validation part asked for more samples than it holds get them all (megatron's
    own unweighted blend stopped at one epoch: too few, no validation at all)."""
    from data_tools.indexed import IndexedReader
    from kvtrain.data import build_datasets

    a, b = _shards(tmp_path, n_docs=(300, 100))
    cfg = _config(tmp_path, cache_dir, a, b)
    cfg["data"]["paths"] = [a, b]
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    tokens_a, tokens_b = IndexedReader(a).num_tokens, IndexedReader(b).num_tokens
    epoch = (tokens_a + tokens_b) // 32  # seq_length 32
    ds = build_datasets(cfg, str(cache_dir), 2 * epoch, 40)
    assert len(ds.train) >= 2 * epoch and len(ds.valid) >= 40
    assert abs(_from_a(ds.train, 400) - 400 * tokens_a / (tokens_a + tokens_b)) <= 2


def test_a_run_trains_and_validates_on_a_blend(tmp_path, cache_dir):
    a, b = _shards(tmp_path)
    cfg = _config(tmp_path, cache_dir, a, b, max_steps=3, eval_interval=3, eval_iters=1)
    result = run(["train", str(write_config(tmp_path / "c.yaml", cfg)),
                  "--run-dir", str(tmp_path / "run")], timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert [r["iteration"] for r in metrics(tmp_path / "run")] == [1, 2, 3]
    assert [r["iteration"] for r in metrics(tmp_path / "run", "valid")] == [3]


def test_a_split_without_the_parts_a_run_draws_from_is_one_line():
    """``data.split`` must give every part the run draws from (validation: with
    ``train.eval_interval``) a share of every shard's documents: said in one line
    naming the split, the part and the shard; parts not drawn from are not built."""
    from kvtrain.config import ConfigError
    from kvtrain.data.datasets import plan_split

    counts = {"a": 1000, "b": 30}
    train_only = [(0, 1.0), None, None]  # megatron's matrix of "100,0,0"
    assert plan_split(train_only, counts, (True, False, False), "100,0,0") == train_only
    with pytest.raises(ConfigError) as e:
        plan_split(train_only, counts, (True, True, False), "100,0,0")
    assert str(e.value) == "data.split '100,0,0' has no validation part"
    small = [(0, 0.99), (0.99, 1.0), None]  # "99,1,0": b's 30 documents give it none
    with pytest.raises(ConfigError) as e:
        plan_split(small, counts, (True, True, False), "99,1,0")
    assert str(e.value) == ("data.split '99,1,0' gives the validation part 0 of the 30 "
                            "documents of b: use more documents or a larger validation weight "
                            "(or set train.eval_interval: null)")
    assert plan_split(small, counts, (True, False, False), "99,1,0") == [(0, 0.99), None, None]


def test_a_preprocess_prefix_names_its_shards(single_rank, tmp_path, cache_dir):
    """``data.paths`` takes what the data tools take: a preprocess
    ``--output-prefix`` (all of its ``_NNNNN_text_document`` shards, or its one
    ``_text_document``) and a dataset's ``.idx``. A prefix's weight is shared among
    its shards by their tokens, as one corpus. It was "shard c.idx does not exist"."""
    from data_tools.indexed import IndexedReader
    from kvtrain.config import ConfigError
    from kvtrain.data import build_datasets
    from kvtrain.data.datasets import _blend
    from kvtrain.data.synthetic import write_shard

    a, b = _shards(tmp_path, n_docs=(300, 100))
    c0, c1 = str(tmp_path / "c_00000_text_document"), str(tmp_path / "c_00001_text_document")
    for src, dst in ((a, c0), (b, c1)):
        for ext in (".bin", ".idx"):
            (tmp_path / (dst + ext)).write_bytes((tmp_path / (src + ext)).read_bytes())
    d = write_shard(tmp_path / "d_text_document", [np.arange(1, 40, dtype=np.int32)] * 50)
    t0, t1 = IndexedReader(c0).num_tokens, IndexedReader(c1).num_tokens
    prefix = str(tmp_path / "c")
    assert _blend([prefix])[0] == ([c0, c1], [float(t0), float(t1)])
    (prefixes, weights), sizes = _blend([0.6, prefix, 0.4, str(tmp_path / "d")])
    assert prefixes == [c0, c1, d] and set(sizes) == {c0, c1, d}
    assert np.allclose(weights, [0.6 * t0 / (t0 + t1), 0.6 * t1 / (t0 + t1), 0.4])
    assert _blend([d + ".idx"])[0] == ([d], None)
    for entry, missing in (("nope", "nope"), ("c_0000", "c_0000"), ("e.idx", "e"),
                           ("c_9*_text_document.idx", "c_9*_text_document")):
        with pytest.raises(ConfigError) as e:
            _blend([str(tmp_path / entry)])
        assert str(e.value) == f"data.paths: shard {tmp_path / missing}.idx does not exist"

    cfg = _config(tmp_path, cache_dir, a, b)
    cfg["data"]["paths"] = [prefix]
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    train = build_datasets(cfg, str(cache_dir), 400, 40).train
    assert abs(_from_a(train, 400) - 400 * t0 / (t0 + t1)) <= 2


# ----------------------------------------------------------------------------- data.valid_paths
def _held_out_config(tmp_path, cache_dir, paths: list, valid: list, **data) -> object:
    cfg = _config(tmp_path, cache_dir, *paths[:2] if len(paths) > 1 else (paths[0], paths[0]),
                  eval_interval=3, eval_iters=2)
    cfg["data"].update({"paths": paths, "valid_paths": valid, "split": "100"}, **data)
    return load_config(write_config(tmp_path / "held_out.yaml", cfg), [])


def test_a_held_out_validation_set_is_all_its_shards_and_the_same_for_any_training_data(
        single_rank, tmp_path, cache_dir):
    """``data.valid_paths``: the validation draws from its shards alone, the training
    from every document of ``data.paths`` (no split carves a part out), and two runs
    on other training corpora validate on the very same sequences."""
    from data_tools.indexed import IndexedReader
    from kvtrain.data import build_datasets

    a, b = _shards(tmp_path)
    (c,) = _shards(tmp_path / "more", n_docs=(200, 1))[:1]  # another corpus below 100
    ds = build_datasets(_held_out_config(tmp_path, cache_dir, [a], [b]), str(cache_dir), 400, 16)
    assert _from_a(ds.train, 400) == 400 and _from_a(ds.valid, 16) == 0
    documents = len(IndexedReader(a).document_indices) - 1
    assert len(ds.train.indices) == documents  # all of a: no validation part of it
    other = build_datasets(_held_out_config(tmp_path, cache_dir, [0.5, a, 0.5, c], [b]),
                           str(cache_dir), 400, 16)
    assert len(other.valid) == len(ds.valid) >= 16
    for i in range(16):
        assert np.array_equal(np.asarray(other.valid[i]["tokens"]),
                              np.asarray(ds.valid[i]["tokens"])), i
    # the split's validation part of the same corpus holds other sequences
    split = _config(tmp_path, cache_dir, a, b, eval_interval=3, eval_iters=2)
    split["data"]["paths"] = [a]
    by_split = build_datasets(load_config(write_config(tmp_path / "s.yaml", split), []),
                              str(cache_dir), 400, 16)
    assert _from_a(by_split.valid, 16) == 16


def test_a_held_out_blend_is_weighted_by_its_tokens(single_rank, tmp_path, cache_dir):
    from data_tools.indexed import IndexedReader
    from kvtrain.data import build_datasets

    a, b = _shards(tmp_path, n_docs=(300, 100))
    (c,) = _shards(tmp_path / "more", n_docs=(200, 1))[:1]
    ds = build_datasets(_held_out_config(tmp_path, cache_dir, [c], [a, b]), str(cache_dir),
                        100, 400)
    tokens_a, tokens_b = IndexedReader(a).num_tokens, IndexedReader(b).num_tokens
    assert len(ds.valid) >= 400
    assert abs(_from_a(ds.valid, 400) - 400 * tokens_a / (tokens_a + tokens_b)) <= 2


@pytest.mark.parametrize("change, error", [
    ({"split": "98,2,0"}, "data.split '98,2,0' gives data.paths validation or test parts, but "
                          "data.valid_paths is the validation set and the training draws from "
                          "all of data.paths: leave data.split out (or give the training part "
                          "alone: '100')"),
    ({"type": "mock"}, "data.valid_paths names shards: it needs data.type gpt, not mock"),
    ({"valid_paths": [0.5, "x", "y"]}, "data.valid_paths must be all prefixes or weight, "
                                       "prefix pairs"),
    ({"valid_paths": [-1, "x"]}, "data.valid_paths weights must be positive finite numbers, got [-1.0]"),
])
def test_held_out_settings_that_cannot_hold_are_one_line(tmp_path, cache_dir, change, error):
    from kvtrain.config import ConfigError

    cfg = _config(tmp_path, cache_dir, "a", "b", eval_interval=3)
    cfg["data"].update({"valid_paths": ["v"], "split": "969,30,1"}, **change)
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path / "c.yaml", cfg), [])
    assert str(e.value).startswith(error), str(e.value)
    cfg["data"].update(valid_paths=["v"], type="gpt", split="100")
    cfg["train"]["eval_interval"] = None  # nothing validates
    with pytest.raises(ConfigError, match="^data.valid_paths is set but train.eval_interval "
                                          "is null: nothing validates on it"):
        load_config(write_config(tmp_path / "c.yaml", cfg), [])


def test_held_out_shards_that_are_missing_or_trained_on_are_one_line(single_rank, tmp_path,
                                                                    cache_dir):
    from kvtrain.config import ConfigError
    from kvtrain.data import build_datasets

    a, b = _shards(tmp_path)
    for valid, error in (([str(tmp_path / "nope")],
                          f"data.valid_paths: shard {tmp_path / 'nope'}.idx does not exist"),
                         ([b, a + ".idx"], f"data.valid_paths: {a} is also in data.paths: a "
                                           "held-out validation set shares no shard with the "
                                           "training data")):
        with pytest.raises(ConfigError) as e:
            build_datasets(_held_out_config(tmp_path, cache_dir, [a], valid), str(cache_dir),
                           10, 16)
        assert str(e.value) == error


def test_a_resume_onto_another_held_out_set_is_refused():
    """Another validation set makes the curve score other sequences from the resume on;
    a checkpoint from before the key compares as the split's validation."""
    from kvtrain.config import to_dict
    from kvtrain.config.compat import config_changes

    saved = to_dict(load_config(None, ["data.paths=[a]"]))
    moved = to_dict(load_config(None, ["data.paths=[a]", "data.valid_paths=[v]", "data.split=100",
                                       "train.eval_interval=10"]))
    keys = [c.key for c in config_changes(saved, moved)]
    assert "data.valid_paths" in keys and "data.split" in keys
    del saved["data"]["valid_paths"]  # written before kvtrain had the key
    assert "data.valid_paths" not in [c.key for c in config_changes(saved, dict(saved))]


def test_a_run_validates_on_its_held_out_set(tmp_path, cache_dir):
    """The trainer with ``data.valid_paths``: it validates (records at the interval),
    and a held-out shard of ids beyond the vocabulary is one line naming
    data.valid_paths, not data.paths."""
    from kvtrain.data.synthetic import write_shard

    a, b = _shards(tmp_path)
    big = write_shard(tmp_path / "big" / "shard",
                      [np.arange(400, 440, dtype=np.int32)] * 20)  # ids over VOCAB
    jobs = []
    for name, valid in (("run", b), ("big", big)):
        cfg = _config(tmp_path, cache_dir, a, b, max_steps=3, eval_interval=3, eval_iters=1)
        cfg["data"].update(paths=[a], valid_paths=[valid], split="100")
        jobs.append({"config": str(write_config(tmp_path / f"{name}.yaml", cfg)),
                     "run_dir": str(tmp_path / name), "log": str(tmp_path / f"{name}.log"),
                     "expect": 0 if name == "run" else 2})
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert [r["iteration"] for r in metrics(tmp_path / "run", "valid")] == [3]
    lines = (tmp_path / "big.log").read_text().strip().splitlines()
    assert lines[-1].startswith("kvtrain: config error: data.valid_paths: a batch holds token "
                                "id 4"), lines[-3:]
    assert "Traceback" not in (tmp_path / "big.log").read_text()


def test_a_blend_of_more_datasets_than_megatron_blends_is_one_line(tmp_path, cache_dir):
    """A preprocess prefix of 32,767 shards (one per input file, the default) named in
    data.paths: megatron's BlendedDataset takes at most 32,766 datasets (an int16
    index). Before: every shard checked and indexed, one by one (hours), then its
    ``AssertionError`` traceback. Now one line naming the key, the count and the way
    out, before any shard is read (the shards here are empty files: unread)."""
    from kvtrain.config import ConfigError
    from kvtrain.data import build_datasets

    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(32767):
        (folder / f"web_{i:05d}_text_document.idx").touch()
    cfg = _config(tmp_path, cache_dir, str(folder / "web"), str(folder / "web"))
    cfg["data"]["paths"] = [str(folder / "web")]
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    with pytest.raises(ConfigError) as e:
        build_datasets(cfg, str(cache_dir), 8, 0)
    assert str(e.value).startswith(
        f"data.paths names 32767 datasets ({folder / 'web'}: 32767 shards); megatron blends at "
        "most 32766: merge them (kvtrain data merge"), str(e.value)
    assert not any((tmp_path / "cache").glob("*"))


def test_a_split_validation_part_smaller_than_a_validation_is_said(single_rank, tmp_path,
                                                                   cache_dir):
    """data.split's validation part read several times over at every validation
    (megatron draws more epochs of its few documents): the held-out sets said so,
    the split's part did not (the same tokens, recorded as val_tokens again and
    again). Its size counted here from the shard's own lengths, not kvtrain's code."""
    from data_tools.indexed import IndexedReader
    from kvtrain.data import build_datasets

    a, b = _shards(tmp_path)
    cfg = _config(tmp_path, cache_dir, a, b, eval_interval=3, eval_iters=5)
    cfg["data"]["paths"] = [a]
    cfg = load_config(write_config(tmp_path / "c.yaml", cfg), [])
    lengths = IndexedReader(a).sequence_lengths
    n = len(lengths)  # split 98,2,0: the validation part is sequences [294, 300)
    held = (int(lengths[int(round(0.98 * n)):].sum()) - 1) // 32
    ds = build_datasets(cfg, str(cache_dir), 40, 40)  # eval_iters 5 x global batch 8
    assert 0 < held < 40 and len(ds.valid) >= 40
    assert ds.warnings == [
        f"kvtrain: warning: the validation part of data.split '98,2,0' holds {held} sequences "
        f"of 32 tokens (one pass over its documents), fewer than the 40 a validation reads "
        f"(train.eval_iters x train.global_batch_size): it reads them {40 / held:.1f} times "
        "over; give it more data (a larger validation weight in data.split), or lower "
        "train.eval_iters"], ds.warnings
    # its first `held` sequences are one pass: distinct, none of the training's
    seen = {np.asarray(ds.valid[i]["tokens"]).tobytes() for i in range(held)}
    train = {np.asarray(ds.train[i]["tokens"]).tobytes() for i in range(len(ds.train))}
    assert len(seen) == held and not seen & train
    assert build_datasets(cfg, str(cache_dir), 40, held).warnings == []  # one pass: quiet
    assert build_datasets(cfg, str(cache_dir), 40, 0).warnings == []  # no validation
