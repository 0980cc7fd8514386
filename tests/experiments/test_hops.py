"""The k-hop induction heads task (Appendix E.1, Figure 8): the hops against the
definition read literally, the samples' layout, the config and its refusals, the
per-hop accuracy through the trainer's validation, and the experiment's results."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtrain.config import ConfigError, load_config
from kvtrain.tasks.config import accuracy_masks
from kvtrain.tasks.hops import HopTask, hop_k, symbol_string
from kvtrain.tasks.sequences import sample_rng


def reference_hops(x: list[int], k: int) -> list[int]:
    """``hop_k`` as the task defines it, one position at a time: from position i,
    find the latest earlier occurrence of the symbol there and step to the position
    after it; -1 once no earlier occurrence exists."""
    out = []
    for i in range(len(x)):
        where = i
        for _ in range(k):
            earlier = [j for j in range(where) if x[j] == x[where]]
            if not earlier:
                where = -1
                break
            where = earlier[-1] + 1
        out.append(where)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_hops_follow_the_definition(seed):
    rng = np.random.default_rng(seed)
    x = symbol_string(rng, 60, 3 + seed % 3)
    for k in range(7):
        assert hop_k(x, k).tolist() == reference_hops(x.tolist(), k), k


def test_a_string_never_repeats_a_symbol_in_a_row_and_uses_all_of_them():
    x = symbol_string(np.random.default_rng(0), 4000, 4)
    assert (x[1:] != x[:-1]).all()
    counts = np.bincount(x, minlength=4)
    assert counts.min() > 900  # every symbol, about uniformly


def test_a_sample_is_the_token_of_k_then_the_string_labelled_by_its_hops():
    task = HopTask(seq_length=40, alphabet=4, min_hops=1, max_hops=5)
    seen = set()
    for index in range(40):
        s = task.sample(7, index)
        k = int(s["tokens"][0]) - 1 + task.min_hops
        seen.add(k)
        x = (s["tokens"][1:] - task.symbol0).tolist()  # the string read so far
        assert all(0 <= c < task.alphabet for c in x)
        where = reference_hops(x, k)
        want = [task.symbol0 + x[w] if w >= 0 else task.missing for w in where]
        assert s["labels"].tolist() == [task.blank] + want
        assert s["loss_mask"].tolist() == [1.0] * 40  # every position trained on
        assert s["hop_all"].tolist() == [False] + [True] * 39  # the blank is not scored
        for count in task.hop_counts:
            assert s[f"hop_{count}"].tolist() == (s["hop_all"].tolist() if count == k
                                                 else [False] * 40)
        assert max(s["tokens"].max(), s["labels"].max()) < task.vocab_size
        assert np.array_equal(task.sample(7, index)["labels"], s["labels"])  # (seed, index)
    assert seen == set(task.hop_counts)
    assert not np.array_equal(task.sample(8, 0)["tokens"], task.sample(7, 0)["tokens"])
    assert sample_rng("hop", 7, 0).integers(1 << 30) != sample_rng("induction", 7, 0).integers(
        1 << 30)


def _hop_config(*sets: str):
    return load_config(None, ["data.type=hop", "model.vocab_size=32", "train.seq_length=32",
                              "model.max_position_embeddings=32", *sets])


def test_the_config_and_its_masks():
    cfg = _hop_config("data.hop.max_hops=3")
    assert cfg.data.hop.vocab_size == 1 + 4 + 4 + 2
    assert accuracy_masks(cfg.data) == ("hop_all", "hop_0", "hop_1", "hop_2", "hop_3")
    assert accuracy_masks("hop") == ("hop_all", "hop_all")  # the results' first/all


@pytest.mark.parametrize("sets, error", [
    (["data.hop.alphabet=1"], "data.hop.alphabet must be >= 2, got 1"),
    (["data.hop.min_hops=4", "data.hop.max_hops=2"], "data.hop: need 0 <= min_hops (4) <= "
                                                      "max_hops (2)"),
    (["data.hop.max_hops=40"], "the hop task's tokens (data.hop: 1 + hop counts + alphabet + "
                               "2) (48) exceeds model.vocab_size (32)"),
    (["data.reset_attention_mask=true", "data.eod_id=1"], "data.type hop has one sequence per "
                                                          "sample"),
])
def test_settings_that_cannot_hold_are_one_line(sets, error):
    with pytest.raises(ConfigError) as e:
        _hop_config(*sets)
    assert error in str(e.value), str(e.value)


def test_the_trainer_scores_every_hop_count(tmp_path):
    """A short run on the task: each validation records the accuracy of every hop
    count, and of all of them (the sequences' share of each count weighting it)."""
    from tests.train.conftest import metrics, run_driver, tiny_config, write_config

    cfg = tiny_config(None, tmp_path / "cache", train={"max_steps": 2, "eval_interval": 2,
                                                       "eval_iters": 2},
                      checkpoint={"save_interval": None})
    cfg["data"] = {"type": "hop", "hop": {"max_hops": 2}, "num_workers": 0}
    cfg["model"]["vocab_size"] = 64
    result = run_driver([{"config": str(write_config(tmp_path / "hop.yaml", cfg)),
                          "run_dir": str(tmp_path / "run")}], tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (record,) = metrics(tmp_path / "run", "valid")
    accuracies = [record[f"val_acc_hop_{k}"] for k in range(3)]
    assert all(0.0 <= a <= 1.0 for a in accuracies + [record["val_acc_hop_all"]])
    task = HopTask(seq_length=32, max_hops=2)
    ks = [int(task.sample(1234 + 1_000_003, i)["tokens"][0]) - 1 for i in range(16)]
    weights = [ks.count(k) for k in range(3)]
    assert record["val_acc_hop_all"] == pytest.approx(
        sum(w * a for w, a in zip(weights, accuracies)) / sum(weights), rel=1e-6)


def test_the_results_read_and_draw_the_errors_by_hop(tmp_path):
    from kvtrain.experiments.results import (ArmResult, format_summary, hop_errors_from_metrics,
                                             plot_hop_errors, summarize, summary_json)

    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "valid", "iteration": 5, "val_loss": 1.0, "val_acc_hop_all": 0.5,
                "val_acc_hop_0": 0.1, "val_acc_hop_1": 0.2},
               {"kind": "valid", "iteration": 10, "val_loss": 0.5, "val_acc_hop_all": 0.75,
                "val_acc_hop_0": 1.0, "val_acc_hop_1": 0.5, "val_acc_hop_10": 0.25}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    errors = hop_errors_from_metrics(path)
    assert errors == {0: 0.0, 1: 0.5, 10: 0.75}  # the last validation, by count
    assert hop_errors_from_metrics(tmp_path / "none.jsonl") == {}
    arms = [ArmResult("kv_shift-2L", [], 1.0, 0, hop_errors=errors),
            ArmResult("vanilla-2L", [], 1.0, 0, hop_errors={0: 0.0, 1: 0.9})]
    plot_hop_errors(arms, tmp_path / "hop_errors.png", title="t")
    assert (tmp_path / "hop_errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = summarize(arms, 2.0)
    assert json.loads(summary_json(summary))["arms"]["vanilla-2L"]["hop_errors"] == \
        {"0": 0.0, "1": 0.9}
    text = format_summary(summary)
    assert "error rate by hops:     0     1    10" in text
    assert "vanilla-2L         0.000 0.900     -" in text


@pytest.mark.slow
def test_a_tiny_fig8_grid_through_kvtrain_train(tmp_path, capsys):
    """Two arms of the preset, each a ``kvtrain train`` process: the summary's error
    rates by hop, hop_errors.png."""
    from kvtrain.cli import main

    run_dir = tmp_path / "fig8"
    sets = ["train.max_steps=2", "train.eval_interval=2", "train.eval_iters=1",
            "train.log_interval=1", "model.hidden_size=32", "model.ffn_hidden_size=64",
            "train.seq_length=24", "data.hop.max_hops=3", "optimizer.lr_warmup_steps=1"]
    assert main(["experiment", "induction", "--preset", "fig8", "--run-dir", str(run_dir),
                 "--arms", "kv_shift-2L,vanilla-2L", "--workers", "2", "--threads", "1",
                 "--no-wandb", *[x for kv in sets for x in ("--set", kv)]]) == 0
    out = capsys.readouterr().out
    assert "error rate by hops:     0     1     2     3" in out
    assert f"{run_dir}/hop_errors.png" in out
    assert (run_dir / "hop_errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    for arm in ("kv_shift-2L", "vanilla-2L"):
        errors = summary["arms"][arm]["hop_errors"]
        assert sorted(errors, key=int) == ["0", "1", "2", "3"]
        assert all(0.0 <= e <= 1.0 for e in errors.values())
