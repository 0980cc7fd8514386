"""``kvtrain perplexity``: a checkpoint scored on shards after training.

Parity with the trainer: the run's checkpoint scored on the shards of one of its
named validation sets gives the loss that set's last record holds (documents
separated, the KV shift's resets, the same sequences); other batches give it too;
TP=2 gives what TP=1 gives. The record lands where ``kvtrain compare`` reads it,
keyed apart by length, sequences and dtype. Bad flags are one line, before any
model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import pytest

from kvtrain.cli import main
from kvtrain.testing import run_distributed
from tests.train.conftest import metrics, run_driver, tiny_config, write_config
from tests.train.test_data_parts import EOD, _shards


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A KV-shift run (documents separated) validating on a held-out shard and on a
    named set of the same shard; its shards; its last validation records."""
    root = tmp_path_factory.mktemp("perplexity")
    a, b = _shards(root)
    cfg = tiny_config(None, root / "cache", train={"max_steps": 4, "eval_interval": 4,
                                                   "eval_iters": 2},
                      checkpoint={"save_interval": 4})
    cfg["data"] = {"type": "gpt", "paths": [a], "valid_paths": [b], "split": "100",
                   "valid_sets": {"held": [b], "train_shard": [b]}, "eod_id": EOD,
                   "reset_attention_mask": True, "num_workers": 0,
                   "cache_dir": str(root / "cache")}
    cfg["model"]["max_position_embeddings"] = 128
    run_dir = root / "run"
    result = run_driver([{"config": str(write_config(root / "c.yaml", cfg)),
                          "run_dir": str(run_dir)}], root / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    last = {r.get("set"): r for r in metrics(run_dir, "valid") if r["iteration"] == 4}
    return {"run": run_dir, "a": a, "b": b, "records": last}


def test_a_checkpoint_scores_what_its_run_validated(mp1, trained, capsys):
    from kvtrain.analysis.runs import read_evals

    run, b = trained["run"], trained["b"]
    assert main(["perplexity", str(run), "--data", b, "--name", "held"]) == 0
    out = capsys.readouterr().out
    path = run / "eval" / "perplexity-held-iter_0000004-n16.json"
    record = json.loads(path.read_text())
    got = record["tasks"]["perplexity/held"]
    want = trained["records"]["held"]
    assert got["loss"] == pytest.approx(want["val_loss"], rel=1e-6, abs=0)
    assert got["tokens"] == want["val_tokens"] == 16 * 32
    assert record["iteration"] == 4 and record["config"]["limit"] == 16
    assert f"held loss {got['loss']:.4f} ppl {got['ppl']:.2f} over 16 sequences of 32 " \
           f"tokens (512 scored)" in out and f"wrote {path}" in out
    assert "kvtrain perplexity: wandb: disabled in the run's config, not logged" in out
    # other batches, the same sequences: the same loss
    assert main(["perplexity", str(run), "--data", b, "--name", "held", "--batch-size", "4",
                 "--out", str(run / "b4.json")]) == 0
    b4 = json.loads((run / "b4.json").read_text())["tasks"]["perplexity/held"]
    assert b4["loss"] == pytest.approx(want["val_loss"], rel=1e-6, abs=0)
    # kvtrain compare reads it as an evaluation of iteration 4 on 16 sequences
    (entry,) = [e for e in read_evals(run)[0] if e["task"] == "perplexity/held"]
    assert (entry["iteration"], entry["limit"], entry["dtype"]) == (4, 16, "fp32")
    assert entry["metrics"]["loss"] == got["loss"]


def test_another_length_or_count_is_another_record(mp1, trained, capsys):
    run, a, b = trained["run"], trained["a"], trained["b"]
    assert main(["perplexity", str(run), "--data", b, "--seq-length", "64", "--sequences", "8",
                 "--batch-size", "4"]) == 0
    path = run / "eval" / "perplexity-shard-iter_0000004-n8-seq64.json"
    record = json.loads(path.read_text())
    (task,) = record["tasks"]
    assert task == "perplexity/shard@64" and record["tasks"][task]["tokens"] == 8 * 64
    # the training shard scores lower than the held-out one (its tokens were learnt)
    assert main(["perplexity", str(run), "--data", a, "--name", "train", "--out",
                 str(run / "train.json")]) == 0
    trained_on = json.loads((run / "train.json").read_text())["tasks"]["perplexity/train"]
    assert trained_on["loss"] < trained["records"]["held"]["val_loss"]
    assert f"train loss {trained_on['loss']:.4f}" in capsys.readouterr().out


def _tp_score(rank, world, run_dir, shard, empty):
    from kvtrain.backend import init_model_parallel
    from kvtrain.config import ConfigError
    from kvtrain.inference.loading import load_model
    from kvtrain.inference.perplexity import Scoring, score

    init_model_parallel(tensor=world)
    try:  # rank 0 looks the checkpoint up; its refusal is every rank's
        load_model(empty)
        refused = None
    except ConfigError as e:
        refused = str(e)
    result = score(load_model(run_dir), Scoring(paths=[shard], name="held", by_position=True))
    return result["loss"], result["by_position"], refused


def test_tp2_scores_as_tp1(mp1, trained, tmp_path):
    from kvtrain.inference.loading import load_model
    from kvtrain.inference.perplexity import Scoring, score

    (tmp_path / "empty").mkdir()
    ranks = run_distributed(_tp_score, 2, str(trained["run"]), trained["b"],
                            str(tmp_path / "empty"))
    assert ranks[0] == ranks[1]
    loss, by, refused = ranks[0]
    assert refused == f"{tmp_path / 'empty'} holds no complete kvtrain checkpoint"
    assert loss == pytest.approx(trained["records"]["held"]["val_loss"], rel=1e-5)
    one = score(load_model(trained["run"]), Scoring(paths=[trained["b"]], name="held",
                                                    by_position=True))["by_position"]
    assert by["tokens"] == one["tokens"]
    assert by["loss"] == pytest.approx(one["loss"], rel=1e-5)


# ----------------------------------------------------------------------------- by position
def test_scoring_writes_nothing_beside_the_shards(mp1, trained, tmp_path, capsys):
    """The scored set's indices are built in memory: megatron's index cache fell back to
    a folder named as the shard's prefix, beside it (``PREFIX/cache/...``), and on
    read-only shards the scoring died in a traceback (a probe's)."""
    import shutil

    from kvtrain.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for suffix in (".bin", ".idx", ".meta.json"):
        if Path(trained["b"] + suffix).exists():
            shutil.copy(trained["b"] + suffix, data)
    prefix = data / Path(trained["b"]).name
    before = sorted(p.name for p in data.iterdir())
    assert main(["perplexity", str(trained["run"]), "--data", str(prefix), "--no-wandb",
                 "--out", str(tmp_path / "p.json")]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in data.iterdir()) == before
    assert not prefix.exists()


def test_a_mock_data_runs_scoring_reads_the_tokenizer_given(tmp_path):
    """A run trained on mock data scores shards like any other: ``--tokenizer`` is read
    and checked (it was never looked at: a folder, a missing file and a vocabulary
    larger than the model's were all taken, a probe's)."""
    from kvtrain.config import ConfigError, load_config
    from kvtrain.data import load_tokenizer
    from kvtrain.inference.perplexity import Scoring, _scoring_config

    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config(None, tmp_path / "cache")),
                      [])
    assert cfg.data.type == "mock"
    s = Scoring(paths=["x"], name="x", tokenizer=str(tmp_path / "nope")).resolved(cfg)
    with pytest.raises(ConfigError, match=f"^--tokenizer {tmp_path / 'nope'}: cannot load"):
        load_tokenizer(_scoring_config(cfg, s).data, cfg.model, key="--tokenizer")


def test_context_positions_count_from_the_sequence_or_the_document():
    import torch

    from kvtrain.inference.positions import context_positions

    tokens = torch.tensor([[5, 9, 1, 9, 9, 3, 4],
                           [9, 2, 2, 2, 9, 9, 7]])  # 9: the end of a document
    assert context_positions(tokens, None).tolist() == [list(range(7))] * 2
    assert context_positions(tokens, 9).tolist() == [[0, 1, 0, 1, 0, 0, 1],
                                                     [0, 0, 1, 2, 3, 0, 0]]


def test_icl_score_and_bins():
    from kvtrain.analysis.positions import binned, icl_score

    means = [3.0 - i / 1000 for i in range(600)]
    assert icl_score(means) == pytest.approx((3.0 - 0.499) - (3.0 - 0.049))
    assert icl_score(means[:499]) is None and icl_score([None] * 600) is None
    bins = binned([4.0, 2.0, 1.0, None, 5.0], [1, 1, 3, 0, 2])
    assert bins == [(1, 1, 4.0), (2, 3, pytest.approx((2.0 + 3.0) / 4)), (4, 5, 5.0)]


def test_the_loss_by_position_is_each_tokens_own(mp1, trained):
    """Against the model run by hand on the same sequences: each scored token's loss
    at its position in its document (the run separated documents), the token-weighted
    mean of all of them the scoring's loss."""
    import torch

    from kvtrain.data import build_scored_set, load_tokenizer
    from kvtrain.inference.loading import load_model
    from kvtrain.inference.perplexity import Scoring, score
    from kvtrain.model.documents import Documents

    loaded = load_model(trained["run"])
    result = score(loaded, Scoring(paths=[trained["b"]], name="held", by_position=True))
    by = result["by_position"]
    assert by["context"] == "document" and sum(by["tokens"]) == result["tokens"]
    cfg = loaded.config
    dataset = build_scored_set(cfg, [trained["b"]], "--data", 16,
                               load_tokenizer(cfg.data, cfg.model))
    sums, counts = [0.0] * 32, [0] * 32
    with torch.no_grad():
        for i in range(16):
            sample = {k: torch.as_tensor(np.asarray(v))[None] for k, v in dataset[i].items()
                      if k in ("tokens", "labels", "loss_mask", "position_ids")}
            batch, packed = Documents(eod=EOD, thd=False)(sample)
            losses = loaded.model(batch["tokens"], batch["position_ids"], None,
                                  labels=batch["labels"], packed_seq_params=packed)[0]  # [s]
            starts = [0] + [j + 1 for j, t in enumerate(sample["tokens"][0].tolist()) if t == EOD]
            for j, loss in enumerate(losses.tolist()):
                if sample["loss_mask"][0, j]:
                    position = j - max(st for st in starts if st <= j)
                    sums[position] += loss
                    counts[position] += 1
    assert by["tokens"] == counts
    assert by["loss"] == pytest.approx([s / c if c else None for s, c in zip(sums, counts)],
                                       rel=1e-5)
    assert result["loss"] == pytest.approx(sum(sums) / sum(counts), rel=1e-6)


def test_by_position_on_the_command_line(mp1, trained, capsys, monkeypatch):
    import kvtrain.evaluate.report as report

    logged = []
    monkeypatch.setattr(report, "log_to_wandb",
                        lambda cfg, run_dir, it, tasks: logged.append((run_dir, it, tasks)) or
                        "wandb: logged to run x (offline)")
    run = trained["run"]
    assert main(["perplexity", str(run), "--data", trained["b"], "--name", "pos",
                 "--by-position", "--out", str(run / "pos.json")]) == 0
    out = capsys.readouterr().out
    # the run's wandb run gets the numbers (the ICL score, None here, left out)
    ((run_dir, iteration, tasks),) = logged
    assert run_dir == run and iteration == 4 and list(tasks) == ["perplexity/pos"]
    assert set(tasks["perplexity/pos"]) == {"loss", "ppl", "tokens"}
    assert "kvtrain perplexity: wandb: logged to run x (offline)" in out
    assert main(["perplexity", str(run), "--data", trained["b"], "--no-wandb",
                 "--out", str(run / "quiet.json")]) == 0
    assert len(logged) == 1 and "wandb" not in capsys.readouterr().out
    record = json.loads((run / "pos.json").read_text())
    by = record["by_position"]
    assert len(by["loss"]) == len(by["tokens"]) == 32 and by["icl_score"] is None
    assert record["tasks"]["perplexity/pos"]["loss"] == pytest.approx(
        trained["records"]["held"]["val_loss"], rel=1e-6)
    assert "loss by tokens of context (in the document): 1 " in out and " 2-3 " in out
    assert "in-context learning score (loss at 500 tokens of context - at 50): needs " \
           "sequences of 500 tokens or more" in out


@pytest.mark.parametrize("flags, error", [
    (["--sequences", "15"], "--sequences 15 is not a multiple of --batch-size 2: every batch "
                            "is whole"),
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    # named the default as if given
    (["--batch-size", "5"], "--sequences 16 (the default: the run's train.eval_iters 2 x "
                            "train.global_batch_size 8) is not a multiple of --batch-size 5"),
    (["--name", "a/b"], "--name 'a/b': letters, digits, '_', '-' and '.', starting with a "
                        "letter or digit"),
    # an empty name was dropped for the default without a word
    (["--name", ""], "--name '': letters, digits, '_', '-' and '.', starting with a letter"),
    (["--seq-length", "256"], "--seq-length 256 is longer than the model's "
                              "model.max_position_embeddings (128)"),
    (["--tokenizer", "/nonexistent/tok.model"], "--tokenizer /nonexistent/tok.model: cannot "
                                                "load"),
])
def test_bad_flags_are_one_line(mp1, trained, capsys, flags, error):
    assert main(["perplexity", str(trained["run"]), "--data", trained["b"], *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"kvtrain: config error: {error}"), err[-3:]
    assert "Traceback" not in "\n".join(err)


def test_bad_sources_and_shards_are_one_line(mp1, trained, tmp_path, capsys):
    run = trained["run"]
    for argv, error in (
            ([str(tmp_path / "nope"), "--data", trained["b"]],
             f"{tmp_path / 'nope'}: no such run folder or checkpoint"),
            ([str(run), "--data", str(tmp_path / "gone")],
             f"--data: shard {tmp_path / 'gone'}.idx does not exist"),
            ([str(run), "--data", "0.5", trained["b"], "x"],
             "--data must be all prefixes or weight, prefix pairs"),
            # nan and inf passed: megatron's assertion, or (one shard) exit 0
            ([str(run), "--data", "nan", trained["b"], "0.5", trained["b"]],
             "--data weights must be positive finite numbers, got [nan, 0.5]"),
            ([str(run), "--data", "inf", trained["b"]],
             "--data weights must be positive finite numbers, got [inf]"),
            ([str(run), "--data", trained["b"], "--out", str(tmp_path)],
             f"--out {tmp_path} is a folder, not a file")):
        assert main(["perplexity", *argv]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
            f"kvtrain: config error: {error}")
    assert not list(tmp_path.iterdir())


def test_a_shard_beyond_the_vocabulary_is_one_line(mp1, trained, tmp_path, capsys):
    from kvtrain.data.synthetic import write_shard

    big = write_shard(tmp_path / "big" / "shard", [np.arange(400, 440, dtype=np.int32)] * 20)
    assert main(["perplexity", str(trained["run"]), "--data", big]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "kvtrain: config error: --data: a batch holds token id 4")


def test_a_shard_is_scored_at_most_once_over(mp1, trained, tmp_path, capsys):
    """A 14-token shard was scored as 100 sequences of 32 tokens (3,200 tokens, its
    own read ~230 times over: megatron draws more epochs), exit 0. Now at most one
    pass: the run's count is lowered to it with a line, more asked for is refused."""
    from kvtrain.data.synthetic import write_shard

    small = write_shard(tmp_path / "small" / "s", [np.arange(1, 41, dtype=np.int32)] * 5)
    tiny = write_shard(tmp_path / "tiny" / "t", [np.arange(1, 15, dtype=np.int32)])
    run, out = str(trained["run"]), tmp_path / "r.json"
    held = "--data holds 6 sequences of 32 tokens (one pass over its shards)"  # 199 // 32
    assert main(["perplexity", run, "--data", small, "--sequences", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"kvtrain: config error: --sequences 8: {held}; more would score its tokens again: "
        "ask for at most 6 (a multiple of --batch-size 2)")
    assert main(["perplexity", run, "--data", small, "--no-wandb", "--out", str(out)]) == 0
    assert f"kvtrain perplexity: {held}: scoring 6 of them, not the run's 16 " \
        "(train.eval_iters x train.global_batch_size)" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["config"]["limit"] == 6 and record["tasks"]["perplexity/s"]["tokens"] == 192
    assert main(["perplexity", run, "--data", tiny]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kvtrain: config error: --data holds 0 sequences of 32 tokens (one pass over its "
        "shards): fewer than one batch of 2; lower --batch-size or --seq-length")


def test_one_pass_over_a_blend_ends_where_its_first_part_does(tmp_path):
    from kvtrain.data import sequences_held
    from kvtrain.data.synthetic import write_shard

    a = write_shard(tmp_path / "a" / "a", [np.arange(1, 41, dtype=np.int32)] * 5)  # 200 tokens
    b = write_shard(tmp_path / "b" / "b", [np.arange(1, 21, dtype=np.int32)] * 5)  # 100
    assert sequences_held([a], "--data", 32) == 6  # 199 // 32
    assert sequences_held([0.5, a, 0.5, b], "--data", 32) == 6  # b's 3 are half of them
    assert sequences_held([0.9, a, 0.1, b], "--data", 32) == 6  # a's 6 are 90 %: 6.67
    assert sequences_held([a, b], "--data", 32) == 9  # one corpus: a by its tokens


def _cuda_scores(rank, world, run_dir, shard):
    """The loss of ``shard`` in fp32, then bf16: one rank for both (each rank a GPU
    machine starts pays the imports and CUDA's start again)."""
    import torch

    from kvtrain.backend import init_model_parallel
    from kvtrain.inference.loading import load_model
    from kvtrain.inference.perplexity import Scoring, score

    init_model_parallel(tensor=world)
    losses = []
    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_model(run_dir, dtype=dtype)
        assert next(loaded.model.parameters()).is_cuda
        losses.append(score(loaded, Scoring(paths=[shard], name="held"))["loss"])
        del loaded
    return losses


@pytest.mark.gpu
def test_on_a_gpu_the_score_is_the_cpus(trained):
    """The CUDA path (model and batches on the device): fp32 as the CPU's run recorded,
    bf16 within its rounding."""
    want = trained["records"]["held"]["val_loss"]
    ((fp32, bf16),) = run_distributed(_cuda_scores, 1, str(trained["run"]), trained["b"],
                                      one_gpu=True)
    assert fp32 == pytest.approx(want, rel=1e-4)
    assert bf16 == pytest.approx(want, rel=2e-2)


def test_compare_plots_the_loss_by_position_of_each_run(tmp_path):
    """``kvtrain compare`` (no torch): the scored tasks in its evaluation table, ICL score
    included, and each run's latest loss by position drawn."""
    from kvtrain.analysis.compare import compare
    from tests.analysis.test_compare import _write_run

    def scored(folder, iteration, slope):
        losses = [5.0 - slope * i for i in range(600)]
        record = {"kind": "perplexity", "iteration": iteration,
                  "tasks": {"perplexity/web": {"loss": 4.0, "ppl": 54.6,
                                               "icl_score": losses[499] - losses[49]}},
                  "config": {"limit": 64, "num_fewshot": None, "dtype": "fp32"},
                  "by_position": {"context": "document", "loss": losses, "tokens": [64] * 600}}
        (folder / "eval").mkdir(exist_ok=True)
        (folder / "eval" / f"perplexity-web-iter_{iteration:07d}-n64.json").write_text(
            json.dumps(record))
        return folder

    a = scored(_write_run(tmp_path / "a", [(100, 2.0)]), 100, 0.001)
    b = scored(scored(_write_run(tmp_path / "b", [(100, 1.9)]), 50, 0.0), 100, 0.002)
    summary, _ = compare([a, b], tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| perplexity/web | 100 | - | 64 | fp32 | - | icl_score | -0.4500 | -0.9000 |" in report
    assert "| perplexity/web | 50 | - | 64 | fp32 | - | icl_score | - | 0.0000 |" in report
    png = tmp_path / "out" / "loss_by_position.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](loss_by_position.png)" in report
    from kvtrain.analysis.plots import _latest_positions
    from kvtrain.analysis.runs import read_run

    assert _latest_positions(read_run(b))["perplexity/web"]["iteration"] == 100


def test_a_checkpoint_of_no_run_folder_writes_only_out(mp1, trained, tmp_path, capsys):
    import shutil

    alone = tmp_path / "iter_0000004"
    shutil.copytree(trained["run"] / "checkpoints" / "iter_0000004", alone)
    assert main(["perplexity", str(alone), "--data", trained["b"]]) == 0
    out = capsys.readouterr().out
    assert f"result not saved ({alone} is in no kvtrain run folder: --out FILE)" in out
    assert "wandb" not in out and sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004"]


def test_every_checkpoint_scored_oldest_first_a_damaged_one_passed_over(mp1, trained, tmp_path,
                                                                        capsys):
    """--checkpoints all: a held-out curve along the training, one record per
    checkpoint (its iteration in its name); a damaged checkpoint is a warning."""
    cfg = tiny_config(None, tmp_path / "cache", train={"max_steps": 6, "eval_interval": 6,
                                                       "eval_iters": 1},
                      checkpoint={"save_interval": 2})
    cfg["data"] = {"type": "gpt", "paths": [trained["a"]], "split": "100",
                   "valid_paths": [trained["b"]], "eod_id": EOD, "num_workers": 0,
                   "cache_dir": str(tmp_path / "cache")}
    run_dir = tmp_path / "run"
    result = run_driver([{"config": str(write_config(tmp_path / "c.yaml", cfg)),
                          "run_dir": str(run_dir)}], tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    damaged = run_dir / "checkpoints" / "iter_0000004"
    victim = max((p for p in damaged.rglob("*") if p.is_file() and p.name != "common.pt"),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-8])  # a torn file: its size is not the listed one
    assert main(["perplexity", str(run_dir), "--data", trained["b"], "--name", "held",
                 "--checkpoints", "all"]) == 0
    out, err = capsys.readouterr()
    assert f"checkpoint {damaged} is damaged" in err and "passed over" in err
    names = sorted(p.name for p in (run_dir / "eval").glob("perplexity-*.json"))
    assert names == ["perplexity-held-iter_0000002-n8.json", "perplexity-held-iter_0000006-n8.json"]
    assert out.index("(iteration 2,") < out.index("(iteration 6,")
    last = json.loads((run_dir / "eval" / names[-1]).read_text())["tasks"]["perplexity/held"]
    assert last["loss"] == pytest.approx(metrics(run_dir, "valid")[-1]["val_loss"], rel=1e-6)
    assert main(["perplexity", str(run_dir), "--data", trained["b"], "--checkpoints", "all",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--out names one file: with --checkpoints all each checkpoint's record goes to "
        "RUN_DIR/eval/ (its iteration in its name)")
