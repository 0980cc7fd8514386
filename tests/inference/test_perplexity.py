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


def _tp_score(rank, world, run_dir, shard):
    from kvtrain.backend import init_model_parallel
    from kvtrain.inference.loading import load_model
    from kvtrain.inference.perplexity import Scoring, score

    init_model_parallel(tensor=world)
    return score(load_model(run_dir), Scoring(paths=[shard], name="held"))["loss"]


def test_tp2_scores_as_tp1(mp1, trained):
    ranks = run_distributed(_tp_score, 2, str(trained["run"]), trained["b"])
    assert ranks[0] == ranks[1]
    assert ranks[0] == pytest.approx(trained["records"]["held"]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("flags, error", [
    (["--sequences", "15"], "--sequences 15 is not a multiple of --batch-size 2: every batch "
                            "is whole"),
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--name", "a/b"], "--name 'a/b': letters, digits, '_', '-' and '.', starting with a "
                        "letter or digit"),
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


def _cuda_score(rank, world, run_dir, shard, dtype):
    import torch

    from kvtrain.backend import init_model_parallel
    from kvtrain.inference.loading import load_model
    from kvtrain.inference.perplexity import Scoring, score

    init_model_parallel(tensor=world)
    loaded = load_model(run_dir, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert next(loaded.model.parameters()).is_cuda
    return score(loaded, Scoring(paths=[shard], name="held"))["loss"]


@pytest.mark.gpu
def test_on_a_gpu_the_score_is_the_cpus(trained):
    """The CUDA path (model and batches on the device): fp32 as the CPU's run recorded,
    bf16 within its rounding."""
    want = trained["records"]["held"]["val_loss"]
    (fp32,) = run_distributed(_cuda_score, 1, str(trained["run"]), trained["b"], "fp32",
                              one_gpu=True)
    (bf16,) = run_distributed(_cuda_score, 1, str(trained["run"]), trained["b"], "bf16",
                              one_gpu=True)
    assert fp32 == pytest.approx(want, rel=1e-4)
    assert bf16 == pytest.approx(want, rel=2e-2)
