"""A sweep's arms pair by pair over settings and seeds (Figure 4), its curves, its
scaling section, and a diverged cell in its table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvtrain.cli import main
from kvtrain.config import ConfigError
from kvtrain.experiments.paired import paired, paired_lines, roles, sign_test
from kvtrain.experiments.sweep import NONFINITE_EXIT, Axis, tables

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
PNG = b"\x89PNG\r\n\x1a\n"

LR = Axis("optimizer.lr", ("1e-3", "1e-2"))
SEED = Axis("train.seed", ("1", "2", "3"))
ATTENTION = Axis("model.attention", ("vanilla", "kv_shift"))


def _entries(losses: dict[tuple[str, str, str], float]) -> list[dict]:
    return [{"cell": "-".join(t), "texts": list(t), "val_loss": v, "finished": True,
             "exit_code": 0, "step": 10} for t, v in losses.items()]


def test_the_roles_of_the_grids_keys():
    assert roles([LR, SEED, ATTENTION], None, None) == (ATTENTION, SEED)
    assert roles([LR, ATTENTION], None, None) == (ATTENTION, None)
    assert roles([LR, SEED], "optimizer.lr", None) == (LR, SEED)
    assert roles([LR, Axis("model.attention", ("kv_shift",))], None, None) == (None, None)
    with pytest.raises(ConfigError, match=r"--arms model.kv_shift.shift: not a --grid key"):
        roles([LR, SEED], "model.kv_shift.shift", None)
    with pytest.raises(ConfigError, match="--replicates data.seed: not a --grid key"):
        roles([LR, SEED], None, "data.seed")
    with pytest.raises(ConfigError, match="are one key"):
        roles([LR, SEED], "train.seed", "train.seed")


def test_the_arms_are_paired_seed_by_seed():
    """kv_shift's loss is vanilla's minus a per-seed amount; one cell diverged (NaN):
    its seed drops out of that setting's pairs, not the other arm's mean."""
    delta = {"1": 0.01, "2": 0.03, "3": -0.02}
    base = {("1e-3", s): 3.0 + int(s) / 10 for s in SEED.texts}
    base.update({("1e-2", s): 3.5 + int(s) / 10 for s in SEED.texts})
    losses = {}
    for (lr, seed), v in base.items():
        losses[(lr, seed, "vanilla")] = v
        losses[(lr, seed, "kv_shift")] = v - delta[seed]
    losses[("1e-2", "3", "vanilla")] = math.nan
    summary = paired([LR, SEED, ATTENTION], _entries(losses), ATTENTION, SEED)
    first, second = summary["rows"]
    assert first["setting"] == {"optimizer.lr": "1e-3"}
    assert first["arms"]["vanilla"]["mean"] == pytest.approx(3.2)
    assert first["arms"]["vanilla"]["sd"] == pytest.approx(0.1)
    d = first["diffs"]["kv_shift"]
    assert d["mean"] == pytest.approx(-sum(delta.values()) / 3) and (d["n"], d["lower"]) == (3, 2)
    assert d["sd"] == pytest.approx(math.sqrt(sum((-x - d["mean"]) ** 2
                                                  for x in delta.values()) / 2))
    assert second["arms"]["vanilla"]["n"] == 2 and second["arms"]["kv_shift"]["n"] == 3
    assert (second["diffs"]["kv_shift"]["n"], second["diffs"]["kv_shift"]["lower"]) == (2, 2)
    overall = summary["overall"]["kv_shift"]
    assert (overall["lower"], overall["pairs"]) == (4, 5)
    assert overall["sign_test_p"] == pytest.approx(sign_test(4, 5))
    text = "\n".join(paired_lines(summary))
    assert "## vanilla vs kv_shift (model.attention), over train.seed" in text
    assert "| 1e-3 | 3.2000 ± 0.1000 (3) |" in text and "| 2/3 |" in text
    assert "kv_shift is lower than vanilla in 4 of 5 pairs (sign test, two-sided: p = 0.375)" \
        in text


def test_the_sign_test():
    assert sign_test(5, 5) == pytest.approx(2 / 32)  # Figure 4a: 5 seeds, 5 lower
    assert sign_test(0, 5) == pytest.approx(2 / 32)
    assert sign_test(3, 6) == 1.0 and sign_test(0, 0) is None
    assert sign_test(9, 10) == pytest.approx(2 * 11 / 1024)


def test_tied_pairs_are_left_out_of_the_sign_test():
    """A pair whose losses are equal (an arm key that changes nothing: bit-identical
    runs) is neither lower nor higher: the sign test drops it (scipy's binomtest over
    the untied pairs). Counted as "not lower", 5 ties read as p = 0.0625 against the
    arm, 10 as p = 0.002."""
    seeds = Axis("train.seed", tuple("123456"))
    losses = {(s, "vanilla"): 3.0 + int(s) / 10 for s in seeds.texts}
    losses.update({(s, "kv_shift"): 3.0 + int(s) / 10 for s in seeds.texts[:5]})  # 5 ties
    losses[("6", "kv_shift")] = losses[("6", "vanilla")] - 0.1  # one lower
    summary = paired([seeds, ATTENTION], _entries(losses), ATTENTION, seeds)
    overall = summary["overall"]["kv_shift"]
    assert overall["sign_test_p"] == 1.0  # 1 lower of 1 untied pair (binomtest(1, 1))
    assert (overall["lower"], overall["pairs"], overall["ties"]) == (1, 6, 5)
    text = "\n".join(paired_lines(summary))
    assert "kv_shift is lower than vanilla in 1 of 6 pairs, 5 tied (sign test over the 1 " \
        "untied, two-sided: p = 1)." in text
    every = {k: 3.0 for k in losses}  # all tied: no test at all
    summary = paired([seeds, ATTENTION], _entries(every), ATTENTION, seeds)
    assert summary["overall"]["kv_shift"]["sign_test_p"] is None
    assert "kv_shift is lower than vanilla in 0 of 6 pairs, 6 tied." in paired_lines(summary)


def test_cells_stopped_short_of_their_steps_are_left_out_of_the_pairs_and_named():
    """A cell that diverged (train.max_consecutive_nonfinite: its last validation, at
    step 40, was finite), crashed or was stopped has no final loss: its last
    validation's loss is not paired with the other arm's final one, nor in its arm's
    mean; the cells are named under the table."""
    losses = {(s, "vanilla"): 3.0 for s in SEED.texts}
    losses.update({(s, "kv_shift"): 2.9 for s in SEED.texts})
    losses[("3", "vanilla")] = 7.5  # diverged at step 40
    losses[("2", "kv_shift")] = 2.5  # crashed at step 5, from its last validation
    entries = _entries(losses)
    by_cell = {tuple(e["texts"]): e for e in entries}
    by_cell[("3", "vanilla")].update(exit_code=NONFINITE_EXIT, finished=False, step=40)
    by_cell[("2", "kv_shift")].update(exit_code=1, finished=False, step=5)
    summary = paired([SEED, ATTENTION], entries, ATTENTION, SEED)
    row = summary["rows"][0]
    assert row["arms"]["vanilla"] == {"mean": 3.0, "sd": 0.0, "n": 2}
    assert row["diffs"]["kv_shift"]["n"] == 1 and row["diffs"]["kv_shift"]["lower"] == 1
    assert (summary["overall"]["kv_shift"]["lower"], summary["overall"]["kv_shift"]["pairs"]) \
        == (1, 1)
    text = "\n".join(paired_lines(summary))
    assert "Left out (no final loss): 3-vanilla (stopped at step 40: non-finite losses), " \
        "2-kv_shift (exit code 1 at step 5)." in text


def test_a_cell_stopped_on_non_finite_losses_is_named_in_the_table():
    from kvtrain.train.loop import EXIT_NONFINITE

    assert NONFINITE_EXIT == EXIT_NONFINITE
    entries = _entries({("1e-3", "vanilla"): 3.0, ("1e-3", "kv_shift"): 2.9,
                        ("1e-2", "vanilla"): 7.5, ("1e-2", "kv_shift"): 3.1})
    entries[2].update(exit_code=NONFINITE_EXIT, finished=False, step=40)
    text = "\n".join(tables([LR, ATTENTION], entries))
    assert "| 1e-2 | 7.5000 (stopped at step 40: non-finite losses) | 3.1000 |" in text


@pytest.mark.slow
def test_a_sweep_of_seeds_sizes_and_arms(tmp_path, capsys):
    """8 tiny cells through kvtrain train: the arms' table from the cells' own records,
    the curves, and the scaling section over the two sizes (the fit's points are the
    seeds' means)."""
    run_dir = tmp_path / "sweep"
    assert main(["sweep", TINY, "--set", "train.max_steps=4", "--set", "train.eval_interval=2",
                 "--no-wandb", "--run-dir", str(run_dir), "--workers", "2", "--threads", "1",
                 "--grid", "model.num_layers=1,2", "--grid", "train.seed=1,2",
                 "--grid", "model.attention=vanilla,kv_shift"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((run_dir / "sweep.json").read_text())
    loss = {tuple(c["texts"]): c["val_loss"] for c in summary["cells"]}
    for cell in summary["cells"]:
        metrics = run_dir / "arms" / cell["cell"] / "run" / "metrics.jsonl"
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
        assert cell["val_loss"] == [r for r in records if r["kind"] == "valid"][-1]["val_loss"]
    for row in summary["paired"]["rows"]:
        layers = row["setting"]["model.num_layers"]
        diffs = [loss[(layers, s, "kv_shift")] - loss[(layers, s, "vanilla")] for s in "12"]
        assert row["diffs"]["kv_shift"]["mean"] == pytest.approx(sum(diffs) / 2)
        assert row["diffs"]["kv_shift"]["lower"] == sum(d < 0 for d in diffs)
    scaled = summary["scaling"]["arms"][0]
    assert [s["runs"] for s in scaled["sizes"].values()] == [2, 2]
    assert [s["loss"] for s in scaled["sizes"].values()] == pytest.approx(
        [(loss[(n, "1", "vanilla")] + loss[(n, "2", "vanilla")]) / 2 for n in "12"])
    for png in ("sweep_curves.png", "scaling.png"):
        assert (run_dir / png).read_bytes()[:8] == PNG
    report = (run_dir / "sweep.md").read_text()
    assert "## vanilla vs kv_shift (model.attention), over train.seed" in report
    assert "![curves](sweep_curves.png)" in report and "[scaling.md](scaling.md)" in report
    assert "kv_shift is lower than vanilla in" in out
    assert (run_dir / "scaling.md").read_text().startswith("# kvtrain sweep: scaling")


def test_curves_beyond_the_panels_a_figure_holds_are_said_not_drawn(tmp_path):
    from kvtrain.experiments.paired import MAX_PANELS, analyse

    lr = Axis("optimizer.lr", tuple(f"{i}e-4" for i in range(1, MAX_PANELS + 2)))
    entries = _entries({(t, a): 3.0 for t in lr.texts for a in ATTENTION.texts})
    run_dirs = {}
    for e in entries:
        folder = run_dirs[e["cell"]] = tmp_path / e["cell"]
        folder.mkdir()
        (folder / "metrics.jsonl").write_text(json.dumps(
            {"kind": "train", "iteration": 1, "consumed_tokens": 64, "lm_loss": 4.0}) + "\n")
        e["params"] = 1000
    lines, out = analyse([lr, ATTENTION], entries, run_dirs, tmp_path)
    assert f"(sweep_curves.png not drawn: {MAX_PANELS + 1} settings, more than {MAX_PANELS} " \
        "panels; `kvtrain compare` draws any cells' curves)" in lines
    assert not (tmp_path / "sweep_curves.png").exists() and "files" not in out
    lines, out = analyse([Axis("optimizer.lr", lr.texts[:2]), ATTENTION], entries[:4],
                         run_dirs, tmp_path)
    assert out["files"] == ["sweep_curves.png"] and "![curves](sweep_curves.png)" in lines
    assert (tmp_path / "sweep_curves.png").read_bytes()[:8] == PNG


def test_cells_stopped_short_are_left_out_of_the_sweeps_scaling_fit(tmp_path):
    """The scaling section fits each arm's final losses against size: a cell that
    diverged or crashed has none (its last validation's loss, steps before the end,
    is not a point of the law); it is left out of the fit and named in its notes."""
    from kvtrain.experiments.paired import analyse
    from tests.analysis.test_scaling import _config, _law, _size, _write_run

    layers = Axis("model.num_layers", ("1", "2", "4"))
    entries, run_dirs = [], {}
    for text in layers.texts:
        n = _size(int(text))
        cell = f"layers={text}"
        run_dirs[cell] = _write_run(tmp_path / cell, _config(int(text)),
                                    _law(n) + (3.0 if text == "4" else 0.0))
        entries.append({"cell": cell, "texts": [text], "val_loss": _law(n), "params": n,
                        "finished": text != "4", "exit_code": 0 if text != "4" else 1,
                        "step": 20 if text != "4" else 10})
    lines, out = analyse([layers], entries, run_dirs, tmp_path)
    sizes = out["scaling"]["arms"][0]["sizes"]
    assert sorted(int(n) for n in sizes) == [_size(1), _size(2)]
    assert out["scaling"]["arms"][0]["fit"]["alpha"] == pytest.approx(0.08, rel=1e-6)
    assert "- note: left out of the fit (stopped short of their steps: no final loss): " \
        "layers=4 (exit code 1 at step 10)" in lines
