"""``data.valid_sets``: named validation sets scored at every evaluation beside the
run's validation. The config's mapping (file, ``--set`` entries, refusals), the sets
built from their shards alone (the same sequences as the same shards held out by
``data.valid_paths``), the trainer's records and wandb names, the resume's rule (a
set added or dropped is recorded, one given other shards refused) and ``kvtrain
compare``'s table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtrain.config import ConfigError, load_config, to_dict
from tests.train.conftest import VOCAB, metrics, run_driver, tiny_config, write_config
from tests.train.test_data_parts import EOD, _from_a, _shards


def _config(tmp_path, cache_dir, paths: list, sets: dict, **data) -> dict:
    cfg = tiny_config(None, cache_dir, train={"eval_interval": 3, "eval_iters": 2},
                      checkpoint={"save_interval": None})
    cfg["data"] = {"type": "gpt", "paths": paths, "split": "98,2,0", "tokenizer": None,
                   "eod_id": EOD, "num_workers": 0, "cache_dir": str(cache_dir),
                   "valid_sets": sets, **data}
    return cfg


def _load(tmp_path, cfg: dict, overrides=()) -> object:
    return load_config(write_config(tmp_path / "sets.yaml", cfg), list(overrides))


# ----------------------------------------------------------------------------- the config
def test_the_sets_load_from_a_file_and_from_set_entries(tmp_path, cache_dir):
    cfg = _load(tmp_path, _config(tmp_path, cache_dir, ["a"], {"code": ["c"],
                                                               "web": [0.5, "w1", 0.5, "w2"]}))
    assert cfg.data.valid_sets == {"code": ["c"], "web": [0.5, "w1", 0.5, "w2"]}
    # an entry set on the command line joins the file's; null removes one
    more = _load(tmp_path, _config(tmp_path, cache_dir, ["a"], {"code": ["c"]}),
                 ["data.valid_sets.math=[m1, m2]", "data.valid_sets.code=null"])
    assert more.data.valid_sets == {"math": ["m1", "m2"]}
    # the resolved config reads back as itself (config.yaml, the checkpoint's record)
    again = load_config(write_config(tmp_path / "again.yaml", to_dict(cfg)), [])
    assert again.data.valid_sets == cfg.data.valid_sets
    assert load_config(None, []).data.valid_sets == {}


@pytest.mark.parametrize("sets, overrides, error", [
    ({"code": "c"}, (), r"sets.yaml:\d+: data.valid_sets.code: expected list of float \| str, "
                        r"got 'c'$"),
    ({"code": [["c"]]}, (), r"sets.yaml:\d+: data.valid_sets.code\[0\]: expected float \| str"),
    ({1: ["c"]}, (), r"sets.yaml:\d+: data.valid_sets: a name must be a non-empty string, got 1$"),
    ({}, ("data.valid_sets=[c]",), r"--set: data.valid_sets: expected mapping of names to list "
                                   r"of float \| str, got \['c'\]$"),
    ({}, ("data.valid_sets.code=3",), r"--set: data.valid_sets.code: expected list of float \| "
                                      r"str, got 3$"),
    ({}, ("data.valid_sets.code.x=[c]",), r"--set: 'data.valid_sets' is a mapping of names to "
                                          r"list of float \| str, its entries are NAME=value$"),
    ({"a/b": ["c"]}, (), r"data.valid_sets.a/b: a set's name is letters, digits, '_', '-' and "
                         r"'.', starting with a letter or digit"),
    ({"code": []}, (), r"data.valid_sets.code is empty: name its shards"),
    ({"code": [0.5, "c", "d"]}, (), r"data.valid_sets.code must be all prefixes or weight, "
                                    r"prefix pairs"),
    ({"code": [0, "c"]}, (), r"data.valid_sets.code weights must be positive finite numbers, got \[0.0\]$"),
])
def test_sets_that_cannot_hold_are_one_line(tmp_path, cache_dir, sets, overrides, error):
    with pytest.raises(ConfigError, match=error):
        _load(tmp_path, _config(tmp_path, cache_dir, ["a"], sets), overrides)


def test_sets_without_shards_or_evaluations_are_one_line(tmp_path, cache_dir):
    cfg = _config(tmp_path, cache_dir, [], {"code": ["c"]}, type="mock")
    with pytest.raises(ConfigError, match="^data.valid_sets names shards: it needs data.type "
                                          "gpt, not mock$"):
        _load(tmp_path, cfg)
    cfg = _config(tmp_path, cache_dir, ["a"], {"code": ["c"]})
    cfg["train"]["eval_interval"] = None
    with pytest.raises(ConfigError, match="^data.valid_sets is set but train.eval_interval is "
                                          "null: nothing validates on them"):
        _load(tmp_path, cfg)


# ----------------------------------------------------------------------------- the datasets
def test_a_set_is_its_shards_alone_and_the_held_out_sequences_of_them(single_rank, tmp_path,
                                                                      cache_dir):
    """Each named set draws from its own shards; it holds the very sequences the same
    shards give as ``data.valid_paths`` (one way of building a held-out set), and
    adding sets changes neither the training data nor the run's validation."""
    from kvtrain.data import build_datasets

    a, b = _shards(tmp_path)
    (c,) = _shards(tmp_path / "more", n_docs=(200, 1))[:1]  # tokens below 100, like a's
    plain = build_datasets(_load(tmp_path, _config(tmp_path, cache_dir, [a], {})),
                           str(cache_dir), 400, 16)
    ds = build_datasets(_load(tmp_path, _config(tmp_path, cache_dir, [a], {"b": [b], "c": [c]})),
                        str(cache_dir), 400, 16)
    assert list(ds.valid_sets) == ["b", "c"]
    assert _from_a(ds.valid_sets["b"], 16) == 0 and _from_a(ds.valid_sets["c"], 16) == 16
    for i in range(16):
        assert np.array_equal(np.asarray(ds.train[i]["tokens"]),
                              np.asarray(plain.train[i]["tokens"])), i
        assert np.array_equal(np.asarray(ds.valid[i]["tokens"]),
                              np.asarray(plain.valid[i]["tokens"])), i
    held = _config(tmp_path, cache_dir, [a], {}, valid_paths=[b], split="100")
    held_out = build_datasets(_load(tmp_path, held), str(cache_dir), 400, 16).valid
    assert len(ds.valid_sets["b"]) >= 16
    for i in range(16):
        assert np.array_equal(np.asarray(ds.valid_sets["b"][i]["tokens"]),
                              np.asarray(held_out[i]["tokens"])), i
    assert plain.valid_sets == {}


def test_a_weighted_set_is_shared_by_its_weights(single_rank, tmp_path, cache_dir):
    from data_tools.indexed import IndexedReader
    from kvtrain.data import build_datasets

    a, b = _shards(tmp_path, n_docs=(300, 100))
    (c,) = _shards(tmp_path / "more", n_docs=(200, 1))[:1]
    ds = build_datasets(_load(tmp_path, _config(tmp_path, cache_dir, [c],
                                                {"mix": [0.25, a, 0.75, b], "both": [a, b]})),
                        str(cache_dir), 100, 400)
    assert abs(_from_a(ds.valid_sets["mix"], 400) - 100) <= 2
    tokens_a, tokens_b = IndexedReader(a).num_tokens, IndexedReader(b).num_tokens
    assert abs(_from_a(ds.valid_sets["both"], 400) - 400 * tokens_a / (tokens_a + tokens_b)) <= 2


def test_set_shards_that_are_missing_or_trained_on_are_one_line(single_rank, tmp_path,
                                                               cache_dir):
    from kvtrain.data import build_datasets

    a, b = _shards(tmp_path)
    for sets, error in (({"code": [b], "gone": [str(tmp_path / "nope")]},
                         f"data.valid_sets.gone: shard {tmp_path / 'nope'}.idx does not exist"),
                        ({"code": [b, a]}, f"data.valid_sets.code: {a} is also in data.paths: "
                                           "a held-out validation set shares no shard with the "
                                           "training data")):
        with pytest.raises(ConfigError) as e:
            build_datasets(_load(tmp_path, _config(tmp_path, cache_dir, [a], sets)),
                           str(cache_dir), 10, 16)
        assert str(e.value) == error


# ----------------------------------------------------------------------------- resume and records
def test_a_resume_records_a_set_added_or_dropped_and_refuses_one_moved():
    from kvtrain.config.compat import check_resume_config

    def record(*sets):
        return to_dict(load_config(None, ["data.paths=[a]", *sets]))

    saved = record("data.valid_sets.code=[c]")
    added = check_resume_config(saved, record("data.valid_sets.code=[c]",
                                              "data.valid_sets.web=[w]"), [], "ckpt")
    assert [(c.key, c.saved, c.current) for c in added] == [("data.valid_sets.web", None, ["w"])]
    dropped = check_resume_config(saved, record(), [], "ckpt")
    assert [(c.key, c.saved, c.current) for c in dropped] == [("data.valid_sets.code", ["c"],
                                                               None)]
    with pytest.raises(ConfigError, match=r"^ckpt was saved by a different run: "
                                          r"data.valid_sets.code: \['c'\] -> \['d'\]\. .*"
                                          r"allow_config_changes: \[data.valid_sets.code\]"):
        check_resume_config(saved, record("data.valid_sets.code=[d]"), [], "ckpt")
    allowed = check_resume_config(saved, record("data.valid_sets.code=[d]"),
                                  ["data.valid_sets"], "ckpt")
    assert [c.key for c in allowed] == ["data.valid_sets.code"]
    # a checkpoint from before the key: no sets
    del saved["data"]["valid_sets"]
    assert check_resume_config(saved, record(), [], "ckpt") == []


def test_the_trainer_scores_every_set_at_every_evaluation(tmp_path, cache_dir):
    """Records of each set after the run's own, at each evaluation; a set of the held-out
    shard scores exactly what the held-out validation does; a set added on a resume
    scores from then on (the change recorded); a set's out-of-vocabulary id names it."""
    from kvtrain.data.synthetic import write_shard

    a, b = _shards(tmp_path)
    (c,) = _shards(tmp_path / "more", n_docs=(200, 1))[:1]
    big = write_shard(tmp_path / "big" / "shard", [np.arange(400, 440, dtype=np.int32)] * 20)
    tiny = write_shard(tmp_path / "tiny" / "shard", [np.arange(1, 41, dtype=np.int32)] * 5)
    cfg = _config(tmp_path, cache_dir, [a], {"same": [b], "c": [c]}, valid_paths=[b], split="100")
    cfg["train"].update(max_steps=3, eval_iters=1)
    cfg["checkpoint"]["save_interval"] = 3
    config = str(write_config(tmp_path / "run.yaml", cfg))
    run_dir = str(tmp_path / "run")
    jobs = [{"config": config, "run_dir": run_dir, "log": str(tmp_path / "run.log")},
            {"config": config, "run_dir": run_dir, "log": str(tmp_path / "resumed.log"),
             "overrides": ["train.max_steps=6", f"data.valid_sets.big={json.dumps([big])}"],
             "expect": 2},
            {"config": config, "run_dir": run_dir, "log": str(tmp_path / "more.log"),
             "overrides": ["train.max_steps=6", f"data.valid_sets.more={json.dumps([c])}",
                           f"data.valid_sets.tiny={json.dumps([tiny])}"]}]
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    valid = metrics(tmp_path / "run", "valid")
    assert [(r["iteration"], r.get("set")) for r in valid] == [
        (3, None), (3, "same"), (3, "c"), (6, None), (6, "same"), (6, "c"), (6, "more"),
        (6, "tiny")]
    for it in (3, 6):
        main, same = (r for r in valid if r["iteration"] == it and r.get("set") in (None, "same"))
        assert same["val_loss"] == main["val_loss"] and same["val_tokens"] == main["val_tokens"]
    by = {(r["iteration"], r.get("set")): r["val_loss"] for r in valid}
    assert by[(3, "c")] != by[(3, None)] and by[(6, "more")] == by[(6, "c")]
    log = (tmp_path / "more.log").read_text()
    assert "| validation more | val_loss" in log
    assert "config changed since the checkpoint: data.valid_sets.more: None -> [" in log
    # 199 // 32 = 6 sequences, a validation reads 8: said (it was recorded unremarked)
    assert "kvtrain: warning: data.valid_sets.tiny holds 6 sequences of 32 tokens (one pass " \
        "over its shards), fewer than the 8 a validation reads" in log
    assert "warning: data.valid_sets" not in (tmp_path / "run.log").read_text()
    events = [r for r in metrics(tmp_path / "run", "event") if "changes" in r]
    assert sorted(events[-1]["changes"]) == ["data.valid_sets.more", "data.valid_sets.tiny"]
    lines = (tmp_path / "resumed.log").read_text().strip().splitlines()
    assert lines[-1].startswith("kvtrain: config error: data.valid_sets.big: a batch holds "
                                f"token id 4"), lines[-3:]
    assert "Traceback" not in (tmp_path / "resumed.log").read_text()
    # found before training on: no step of the resume was lost to it
    assert not [line for line in lines if line.startswith("iter ")], lines[-5:]


def test_a_sets_curves_go_to_wandb_under_its_name():
    from kvtrain.train.metrics import MetricsLogger

    record = {"kind": "valid", "set": "code", "iteration": 6, "val_loss": 2.5, "val_ppl": 12.2,
              "val_tokens": 64}
    assert MetricsLogger._wandb_view(record) == {
        "iteration": 6, "valid/code/val_loss": 2.5, "valid/code/val_ppl": 12.2,
        "valid/code/val_tokens": 64}
    main = {k: v for k, v in record.items() if k != "set"}
    assert "valid/val_loss" in MetricsLogger._wandb_view(main)
    assert MetricsLogger._line(record).startswith("iter       6 | validation code | val_loss 2.5")
    assert VOCAB < 400  # the big shard's ids above are out of the vocabulary


# ----------------------------------------------------------------------------- kvtrain compare
def test_compare_reads_each_set_on_its_own(tmp_path):
    from kvtrain.analysis.compare import compare
    from tests.analysis.test_compare import _write_run

    def with_sets(folder, sets: dict):
        lines = [json.dumps({"kind": "valid", "set": name, "iteration": it, "val_loss": loss,
                             "val_ppl": 1.0, "val_tokens": 64}) for name, points in sets.items()
                 for it, loss in points]
        path = folder / "metrics.jsonl"
        path.write_text(path.read_text().rsplit("\n", 1)[0] + "\n" + "\n".join(lines) + "\n")
        return folder

    a = with_sets(_write_run(tmp_path / "a", [(50, 3.0), (100, 2.0)]),
                  {"code": [(50, 4.0), (100, 3.0)], "only_a": [(100, 1.0)]})
    # B reaches A's 3.0 on code half-way between iterations 40 (3.5) and 60 (2.5)
    b = with_sets(_write_run(tmp_path / "b", [(50, 2.5), (100, 1.5)]),
                  {"code": [(40, 3.5), (60, 2.5), (100, 2.25)], "only_b": [(100, 9.0)]})
    summary, printed = compare([a, b], tmp_path / "out")
    ra, rb = summary["runs"]
    assert ra["val_loss"] == 2.0 and rb["val_loss"] == 1.5  # the run's own curve alone
    assert ra["valid_sets"] == {"code": {"iteration": 100, "val_loss": 3.0},
                                "only_a": {"iteration": 100, "val_loss": 1.0}}
    code = rb["vs_reference"]["valid_sets"]["code"]
    assert code["val_loss_diff"] == pytest.approx(-0.75)
    assert code["b_tokens"] == pytest.approx(50 * 256) and code["speedup"] == pytest.approx(2.0)
    assert list(rb["vs_reference"]["valid_sets"]) == ["code"]  # sets both runs have
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Validation sets (data.valid_sets)" in report
    assert "| code | b | 100 | 2.2500 | -0.7500 | 12.80k tokens vs 25.60k: 2.00x |" in report
    assert "| code | a | 100 | 3.0000 | (A) | - |" in report
    assert "| only_b | b | 100 | 9.0000 | - | - |" in report
    assert "set code: val 2.2500  (val - A -0.7500; to reach A: 12.80k tokens vs 25.60k: " \
           "2.00x)" in printed
    png = tmp_path / "out" / "valid_sets.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](valid_sets.png)" in report
    # runs without named sets draw no such plot
    plain = [_write_run(tmp_path / name, [(50, 3.0), (100, 2.0)]) for name in ("c", "d")]
    compare(plain, tmp_path / "plain")
    assert not (tmp_path / "plain" / "valid_sets.png").exists()


def test_the_demo_summary_reads_the_runs_own_validation(tmp_path):
    from kvtrain.commands.demo import summarize

    records = [{"kind": "train", "iteration": 10, "lm_loss": 3.0, "consumed_tokens": 640,
                "tokens_per_s": 100.0},
               {"kind": "valid", "iteration": 10, "val_loss": 2.0, "val_ppl": 7.39},
               {"kind": "valid", "set": "code", "iteration": 10, "val_loss": 9.0,
                "val_ppl": 8103.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "validation loss 2.000 (perplexity 7.4) at iter 10" in summarize(tmp_path)


def test_two_ranks_score_the_sets_alike(tmp_path, cache_dir):
    """DP=2: every rank builds the sets (rank 0 first, writing their index caches) and
    scores its share of their batches; a set of the held-out shard is the held-out
    validation, bit for bit, and two data-parallel ranks score it as one does."""
    a, b = _shards(tmp_path)
    cfg = _config(tmp_path, cache_dir, [a], {"same": [b]}, valid_paths=[b], split="100")
    cfg["train"].update(max_steps=2, eval_interval=2, eval_iters=1)
    config = str(write_config(tmp_path / "dp.yaml", cfg))
    jobs = [{"config": config, "run_dir": str(tmp_path / "dp2")}]
    result = run_driver(jobs, tmp_path / "plan.json", nproc=2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    one = run_driver([{"config": config, "run_dir": str(tmp_path / "dp1")}],
                     tmp_path / "plan1.json")
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    two, single = metrics(tmp_path / "dp2", "valid"), metrics(tmp_path / "dp1", "valid")
    assert [r.get("set") for r in two] == [None, "same"] == [r.get("set") for r in single]
    assert two[0]["val_loss"] == two[1]["val_loss"]
    assert two[1]["val_tokens"] == single[1]["val_tokens"]
    assert two[1]["val_loss"] == pytest.approx(single[1]["val_loss"], rel=1e-5)


def test_a_set_smaller_than_a_validation_is_said_at_the_start(tmp_path, cache_dir):
    """A held-out set of 14 tokens was read ~9 times a validation (megatron draws more
    epochs) and recorded as 128 tokens, unremarked: now a warning names it."""
    from kvtrain.data import validation_read_over
    from kvtrain.data.synthetic import write_shard

    small = write_shard(tmp_path / "small" / "s", [np.arange(1, 41, dtype=np.int32)] * 5)
    big = write_shard(tmp_path / "big" / "b", [np.arange(1, 41, dtype=np.int32)] * 20)
    cfg = _load(tmp_path, _config(tmp_path, cache_dir, ["a"], {"small": [small], "big": [big]},
                                  valid_paths=[big], split="100"))
    valid = cfg.train.eval_iters * cfg.train.global_batch_size  # 16 sequences of 32 tokens
    assert validation_read_over(cfg, valid) == [
        "kvtrain: warning: data.valid_sets.small holds 6 sequences of 32 tokens (one pass over "
        "its shards), fewer than the 16 a validation reads (train.eval_iters x "
        "train.global_batch_size): it reads them 2.7 times over; give it more data, or lower "
        "train.eval_iters"]  # big: 799 // 32 = 24
    assert validation_read_over(cfg, 0) == []  # no validation
