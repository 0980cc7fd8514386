"""``kvtrain scaling``: loss against model size per attention (Figure 6a), on run
folders with the trainer's record shapes whose losses follow known power laws."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from kvtrain.analysis.scaling import arm_name, fit_power_law, model_params, scaling
from kvtrain.cli import main
from kvtrain.config import ConfigError, load_config, to_dict
from kvtrain.plan.params import count_params

PNG = b"\x89PNG\r\n\x1a\n"
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
ALPHA, N_C = 0.08, 1.0e13  # the law the synthetic vanilla runs follow


def _config(layers: int, attention: str = "vanilla", sets=()) -> dict:
    return to_dict(load_config(TINY, [f"model.num_layers={layers}",
                                      f"model.attention={attention}", *sets]))


def _size(layers: int) -> int:
    """Non-embedding parameters of the vanilla model (configs/tiny.yaml's is KV shift)."""
    counts = count_params(load_config(TINY, [f"model.num_layers={layers}",
                                             "model.attention=vanilla"]).model)
    return counts.non_embedding


def _write_run(folder: Path, config: dict, val_loss: float, sets: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    diverged = math.isnan(val_loss)  # written as the trainer does: "nan"
    records = [{"kind": "train", "iteration": it, "consumed_tokens": 256 * it,
                "lm_loss": 9.0 if diverged else val_loss + 1.0, "lr": 1e-3} for it in (10, 20)]
    records += [{"kind": "valid", "iteration": it, "val_loss": "nan" if diverged else loss}
                for it, loss in ((10, val_loss + 0.5), (20, val_loss))]
    records += [{"kind": "valid", "set": name, "iteration": 20, "val_loss": loss}
                for name, loss in (sets or {}).items()]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _law(n: float, gain: float = 1.0) -> float:
    """Vanilla's loss at ``n`` parameters (``gain``: the loss vanilla has at gain x n)."""
    return (N_C / (n * gain)) ** ALPHA


def test_the_fit_recovers_the_law_and_the_parameters_vanilla_needs(tmp_path, capsys):
    """Vanilla on L(N) = (N_c/N)^alpha exactly; KV shift at each size with the loss of a
    vanilla model 1.5x its size: alpha, N_c, R^2 = 1 and the multiple 1.5 come back."""
    runs = []
    for layers in (1, 2, 4):
        n = _size(layers)
        runs.append(_write_run(tmp_path / f"v{layers}", _config(layers), _law(n)))
        runs.append(_write_run(tmp_path / f"k{layers}", _config(layers, "kv_shift"),
                               _law(n, 1.5)))
    assert main(["scaling", *map(str, runs), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "scaling.json").read_text())
    vanilla, shifted = summary["arms"]
    assert (summary["reference"], vanilla["arm"], shifted["arm"]) == \
        ("vanilla", "vanilla", "kv_shift")
    for arm in (vanilla, shifted):  # the same law, shifted in N: the same exponent
        assert arm["fit"]["alpha"] == pytest.approx(ALPHA, rel=1e-9)
        assert arm["fit"]["r2"] == pytest.approx(1.0) and arm["fit"]["sizes"] == 3
    assert vanilla["fit"]["n_c"] == pytest.approx(N_C, rel=1e-6)
    assert shifted["fit"]["n_c"] == pytest.approx(N_C / 1.5, rel=1e-6)
    multiples = shifted["vs_reference"]
    assert [m["multiple"] for m in multiples.values()] == pytest.approx([1.5] * 3)
    # 1.5x the largest size is past the sizes vanilla was measured at
    assert [m["extrapolated"] for m in multiples.values()] == [False, False, True]
    assert summary["notes"] == []  # the runs differ in size and attention only
    report = (tmp_path / "out" / "scaling.md").read_text()
    assert "| 1.50x |" in report and "1.50x (extrapolated)" in printed
    assert (tmp_path / "out" / "scaling.png").read_bytes()[:8] == PNG


def test_the_size_is_the_models_without_embeddings_or_shift_coefficients():
    vanilla, shifted = _config(2), _config(2, "kv_shift")
    n, total = model_params(vanilla, "x")
    assert (n, total) == model_params(shifted, "x")  # one architecture, one size
    counts = count_params(load_config(TINY, ["model.attention=kv_shift"]).model)
    # 2 layers x 2 KV heads x (alpha1, alpha2, beta1, beta2)
    assert counts.non_embedding - n == counts.kv_shift == 2 * 2 * 4
    assert total - n == counts.embedding
    with pytest.raises(ConfigError, match="x: its model cannot be counted"):
        model_params({"model": {"hidden_sise": 64}}, "x")


def test_arms_seeds_and_named_sets(tmp_path):
    """Seeds of one size are one point (their mean), another learning rate is noted;
    K-only shifting is its own arm; --valid-set fits a named set's loss; a run without a
    finite loss is left out, said."""
    runs = [
        _write_run(tmp_path / "v1a", _config(1), 4.0, {"web": 5.0}),
        _write_run(tmp_path / "v1b", _config(1, sets=["train.seed=2"]), 4.2, {"web": 5.2}),
        _write_run(tmp_path / "v2", _config(2, sets=["optimizer.lr=1e-2"]), 3.9, {"web": 4.9}),
        _write_run(tmp_path / "k1", _config(1, "kv_shift", ["model.kv_shift.shift=[k]"]), 4.0,
                   {"web": 5.0}),
        _write_run(tmp_path / "k2", _config(2, "kv_shift", ["model.kv_shift.shift=[k]"]),
                   math.nan, {"web": 4.8}),
    ]
    summary, _ = scaling(runs, tmp_path / "out")
    vanilla, k_only = summary["arms"]
    assert k_only["arm"] == "kv_shift (shift=['k'])"
    assert vanilla["sizes"][str(_size(1))] == {"loss": pytest.approx(4.1), "runs": 2}
    assert k_only["fit"] is None  # its 2-layer run has no finite loss: one size left
    assert any(n.startswith("v2 differs from v1a beyond its size and attention: "
                            "optimizer.lr: 0.003 -> 0.01") for n in summary["notes"])
    assert not any("train.seed" in n for n in summary["notes"])  # seeds are replicates
    assert any(n.startswith("k2: no finite validation loss") for n in summary["notes"])
    web, _ = scaling(runs, tmp_path / "web", valid_set="web")
    assert web["arms"][1]["fit"] is not None and web["valid_set"] == "web"
    assert web["arms"][0]["sizes"][str(_size(2))]["loss"] == pytest.approx(4.9)
    with pytest.raises(ConfigError, match="no validation set 'code' in its records"):
        scaling(runs, tmp_path / "code", valid_set="code")


def test_a_sweep_folder_stands_for_its_cells(tmp_path):
    for i, layers in enumerate((1, 2)):
        _write_run(tmp_path / "sweep" / "arms" / f"layers={layers}" / "run", _config(layers),
                   4.0 - i / 10)
    summary, _ = scaling([tmp_path / "sweep"], tmp_path / "out")
    assert [r["label"] for r in summary["runs"]] == ["layers=1/run", "layers=2/run"]
    # without --out: scaling/ in the sweep folder, not in its arms/ among the cells
    _, text = scaling([tmp_path / "sweep"])
    assert (tmp_path / "sweep" / "scaling" / "scaling.md").is_file(), text
    assert not (tmp_path / "sweep" / "arms" / "scaling").exists()


def test_what_cannot_be_fitted_is_one_line_and_writes_nothing(tmp_path, capsys):
    one = _write_run(tmp_path / "a", _config(2), 4.0)
    other = _write_run(tmp_path / "b", _config(2, "kv_shift"), 3.9)
    assert main(["scaling", str(one), str(other), "--out", str(tmp_path / "out")]) == 2
    assert "no arm has runs of two model sizes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["scaling", str(one)]) == 2
    assert "needs at least two runs" in capsys.readouterr().err
    assert main(["scaling", str(one), str(tmp_path / "nothing")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    # one path, not there: named, not "needs at least two runs" (a probe's)
    assert main(["scaling", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == (f"kvtrain: config error: {tmp_path / 'nothing'}: no "
                                       "such run folder\n")
    bare = _write_run(tmp_path / "bare", _config(1), 4.2)
    (bare / "config.yaml").unlink()  # its records only: its size is unknown
    assert main(["scaling", str(one), str(bare)]) == 2
    assert f"{bare} has no config.yaml: its model size is unknown" in capsys.readouterr().err
    runs = [str(one), str(_write_run(tmp_path / "c", _config(1), 4.1))]
    (tmp_path / "file").write_text("")
    assert main(["scaling", *runs, "--out", str(tmp_path / "file" / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"kvtrain: config error: --out "
                                              f"{tmp_path / 'file' / 'out'}: cannot create it")


def test_the_multiple_is_read_between_the_measured_sizes_not_on_the_fit(tmp_path):
    """Vanilla's points off a power law: KV shift's loss at the smallest size lies
    between vanilla's two smallest, so the multiple is read on that segment (log-log)."""
    losses = {1: 5.0, 2: 4.7, 4: 4.6}
    runs = [_write_run(tmp_path / f"v{n}", _config(n), loss) for n, loss in losses.items()]
    runs += [_write_run(tmp_path / f"k{n}", _config(n, "kv_shift"), loss - 0.15)
             for n, loss in losses.items()]
    summary, _ = scaling(runs, tmp_path / "out")
    t = (math.log(4.85) - math.log(5.0)) / (math.log(4.7) - math.log(5.0))
    needed = math.exp(math.log(_size(1)) + t * (math.log(_size(2)) - math.log(_size(1))))
    first = summary["arms"][1]["vs_reference"][str(_size(1))]
    assert first["needed"] == pytest.approx(needed) and not first["extrapolated"]
    assert summary["arms"][1]["vs_reference"][str(_size(4))]["extrapolated"]  # below 4.6


def test_a_loss_that_does_not_fall_with_size_is_said(tmp_path):
    runs = [_write_run(tmp_path / f"{a}{n}", _config(n, a), 4.0 + n / 100 - (a == "kv_shift") / 10)
            for n in (1, 2) for a in ("vanilla", "kv_shift")]
    summary, text = scaling(runs, tmp_path / "out")
    assert summary["arms"][1]["vs_reference"][str(_size(1))] is None
    assert "vanilla: the loss does not fall with size (alpha -0.0" in text
    assert "limited by their tokens or steps" in (tmp_path / "out" / "scaling.md").read_text()


def test_the_fit_itself():
    assert fit_power_law([(10.0, 2.0)]) is None  # one size
    fit = fit_power_law([(1e6, 4.0), (1e7, 3.0), (1e8, 2.5)])
    assert fit.r2 < 1.0 and fit.alpha > 0 and fit.points == 3
    assert fit.size_for(fit.loss(5e6)) == pytest.approx(5e6)
    assert fit_power_law([(1e6, 3.0), (1e7, 3.5)]).size_for(3.2) is None  # a rising loss
    assert arm_name({"model": {"attention": "kv_shift", "kv_shift": {"window": 2}}}) == \
        "kv_shift (window=2)"
    assert arm_name({"model": {"attention": "kv_shift", "kv_shift": {"kernel": "torch"}}}) == \
        "kv_shift"  # how the shift ran is not another arm


def _multiples(summary: dict) -> dict:
    return summary["arms"][1]["vs_reference"]


def _two_arms(tmp_path, vanilla: dict, shifted: dict) -> tuple[dict, str]:
    """``kvtrain scaling`` of a vanilla and a KV-shift run per size ({layers: loss})."""
    runs = [_write_run(tmp_path / f"v{n}", _config(n), loss) for n, loss in vanilla.items()]
    runs += [_write_run(tmp_path / f"k{n}", _config(n, "kv_shift"), loss)
             for n, loss in shifted.items()]
    return scaling(runs, tmp_path / "out")


def test_a_reference_that_falls_then_rises_gives_no_multiple_its_note_denies(tmp_path):
    """The probe's shape (sweep of 1, 2, 3 tiny layers): vanilla falls from 1 to 2 layers
    and rises past its first loss at 3, so its fit does not fall with size; KV shift is
    worse at 1 layer, better at 2 and 3. The note says no size multiple is given, and
    none is (before: 2x at 1 layer, read on the rising segment, where KV shift is worse,
    and < 1 at 3 layers, where it is better)."""
    vanilla = {1: 5.6368, 2: 5.6010, 3: 5.6500}
    shifted = {1: 5.6392, 2: 5.5950, 3: 5.6300}
    summary, text = _two_arms(tmp_path, vanilla, shifted)
    assert summary["arms"][0]["fit"]["alpha"] <= 0
    assert "vanilla: the loss does not fall with size" in text
    assert _multiples(summary) == {str(_size(n)): None for n in (1, 2, 3)}
    report = (tmp_path / "out" / "scaling.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| ") and "|---" not in line]
    assert all(line.endswith("| - |") for line in table[1:])  # the multiple column: "-"


def test_the_multiple_is_read_only_where_the_reference_falls(tmp_path):
    """Vanilla falls from 1 to 2 layers and rises to 3 (its fit still falls): KV shift
    worse at 1 layer is reached below 1 layer (by the fitted exponent from vanilla's
    point, < 1); better at 2 and 3 layers, a loss vanilla's falling part does not reach
    above those sizes: no multiple, and a note says why (before: 4.55 at 3 layers, better
    than vanilla's 4.6, was read on the 1-2 segment as < 1)."""
    vanilla = {1: 5.0, 2: 4.5, 3: 4.6}
    shifted = {1: 5.05, 2: 4.45, 3: 4.55}
    summary, text = _two_arms(tmp_path, vanilla, shifted)
    fit = summary["arms"][0]["fit"]
    assert fit["alpha"] > 0
    first = _multiples(summary)[str(_size(1))]
    assert first["extrapolated"] and first["multiple"] < 1
    # on vanilla's line through its 1-layer point with the fitted slope
    needed = _size(1) * math.exp((math.log(5.05) - math.log(5.0)) / fit["slope"])
    assert first["needed"] == pytest.approx(needed)
    assert _multiples(summary)[str(_size(2))] is None
    assert _multiples(summary)[str(_size(3))] is None
    unreached = [n for n in summary["notes"] if "not reached" in n]
    assert len(unreached) == 2 and all(n.startswith("kv_shift at ") for n in unreached)
    assert "lower than vanilla's 4.6000 there" in unreached[1]
    assert "not reached" in (tmp_path / "out" / "scaling.md").read_text()


def test_a_multiple_is_below_one_where_the_arm_is_worse_above_where_better():
    """On many synthetic curves (falling, rising, zigzag): every multiple given is < 1
    where the arm's loss is above the reference's at that size and > 1 where below; none
    is given where either fit does not fall with size; each one read lies where the
    reference's loss falls."""
    import random

    from kvtrain.analysis.scaling import Point, arms_of, size_multiple

    rng = random.Random(0)
    sizes = [1000 * 2 ** k for k in range(5)]
    given = 0
    for _ in range(300):
        count = rng.randint(2, 5)
        ref = [5.0 - 0.2 * k + rng.uniform(-0.3, 0.3) for k in range(count)]
        arm = [loss + rng.uniform(-0.3, 0.3) for loss in ref]
        points = [Point(f"v{k}", "vanilla", sizes[k], sizes[k], ref[k], None)
                  for k in range(count)]
        points += [Point(f"k{k}", "kv_shift", sizes[k], sizes[k], arm[k], None)
                   for k in range(count)]
        reference, other = arms_of(points)
        for k in range(count):
            m = size_multiple(reference, other, sizes[k])
            if reference.fit.alpha <= 0 or other.fit.alpha <= 0:
                assert m is None
                continue
            if m is None:
                continue
            given += 1
            if arm[k] > ref[k]:
                assert m["multiple"] < 1
            elif arm[k] < ref[k]:
                assert m["multiple"] > 1
            if not m["extrapolated"]:  # within a segment where vanilla's loss falls
                j = max(i for i in range(count) if sizes[i] <= m["needed"] * (1 + 1e-12))
                j = min(j, count - 2)
                assert ref[j + 1] < ref[j]
    assert given > 100


def test_the_total_is_counted_with_the_vocabulary_the_run_padded_for_its_tp(tmp_path):
    """A run at TP 2 pads its vocabulary to make_vocab_size_divisible_by x 2 (megatron's
    rule, as it trained): its total is that model's, not the TP 1 padding's (before: 300
    words padded to 320, not 384: 2 x 64 x 64 parameters fewer than trained); the non-embedding
    size, what the law is fitted on, is one for every TP."""
    sets = ["model.vocab_size=300"]
    at_tp2 = _config(2, sets=sets + ["parallel.tensor=2"])
    model = load_config(TINY, ["model.num_layers=2", "model.attention=vanilla", *sets]).model
    trained = count_params(model, 2)
    assert trained.vocab_padded == 384 and count_params(model).vocab_padded == 320
    n, total = model_params(at_tp2, "x")
    assert total == trained.total
    assert n == model_params(_config(2, sets=sets), "x")[0] == trained.non_embedding
    runs = [_write_run(tmp_path / f"v{layers}", _config(layers, sets=sets + ["parallel.tensor=2"]),
                       4.0 - layers / 10) for layers in (1, 2)]
    summary, _ = scaling(runs, tmp_path / "out")
    assert summary["runs"][1]["total"] == trained.total


def test_a_nearly_flat_law_is_reported_not_an_overflow(tmp_path, capsys):
    """Tiny models whose loss barely falls with size (a demo sweep's: 5.6 to 5.5992 from
    1 to 2 layers, alpha 1e-4): N_c = exp(intercept / alpha) and the size vanilla needs
    for KV shift's loss 0.5 lower lie past a float; both are said, not a traceback
    (before: OverflowError: math range error, and no report)."""
    runs = [_write_run(tmp_path / f"v{n}", _config(n), 5.6 - n * 0.0004) for n in (1, 2)]
    runs += [_write_run(tmp_path / f"k{n}", _config(n, "kv_shift"), 5.1 - n * 0.0004)
             for n in (1, 2)]
    assert main(["scaling", *map(str, runs), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "scaling.json").read_text())
    vanilla, shifted = summary["arms"]
    assert 0 < vanilla["fit"]["alpha"] < 1e-3 and vanilla["fit"]["n_c"] is None
    assert "- vanilla: alpha 0.0001, N_c - (2 sizes)" in printed
    assert list(shifted["vs_reference"].values()) == [None, None]
    beyond = [n for n in summary["notes"] if "more parameters than a float holds" in n]
    assert len(beyond) == 2 and beyond[0].startswith("kv_shift at ")
    assert fit_power_law([(1e6, 5.6), (2e6, 5.5996)]).size_for(5.0) is None


def _cut(run: Path, after: int) -> None:
    """The run's records up to iteration ``after``: a run still running, or stopped there."""
    metrics = run / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines()
            if json.loads(line)["iteration"] <= after]
    metrics.write_text("".join(line + "\n" for line in kept))


def test_a_run_short_of_its_steps_is_left_out_of_the_fit_and_said(tmp_path, capsys):
    """A run still running (or stopped, crashed, diverged) has no final loss: its last
    finite validation, at iteration 10 of its 20 steps, is left out of the fit with a note,
    as a sweep leaves out its cells stopped short (before: fitted as if final, 4.1 at 4
    layers turned the law around and the note blamed the runs' tokens)."""
    runs = [_write_run(tmp_path / f"v{n}", _config(n), 4.0 - n / 10) for n in (1, 2, 4)]
    _cut(runs[2], 10)
    summary, text = scaling(runs, tmp_path / "out")
    vanilla = summary["arms"][0]
    assert str(_size(4)) not in vanilla["sizes"] and vanilla["fit"]["alpha"] > 0
    assert "v4: its last finite validation is at iteration 10, short of its 20 steps " \
        "(train.max_steps): still running or stopped, its loss is not final (left out)" in text
    metrics = runs[2] / "metrics.jsonl"  # diverged: its validation at its last step is nan
    metrics.write_text(metrics.read_text() + '{"kind": "valid", "iteration": 20, '
                       '"val_loss": "nan"}\n')
    _, text = scaling(runs, tmp_path / "out")
    assert "v4: its last finite validation is at iteration 10, short of its 20 steps " \
        "(train.max_steps): the later ones are not finite, its loss is not final" in text
    tokens = [_write_run(tmp_path / f"t{n}", _config(n, sets=["train.train_tokens=5120"]),
                         4.0 - n / 10) for n in (1, 2, 4)]
    _cut(tokens[0], 10)  # 2560 of its 5120 tokens
    summary, text = scaling(tokens, tmp_path / "tokens")
    assert "t1: its last finite validation is at 2560 tokens, short of its 5120 " \
        "(train.train_tokens)" in text and summary["arms"][0]["fit"]["sizes"] == 2
    _cut(tokens[1], 10)  # two sizes left out: no fit, said in the one line
    assert main(["scaling", *map(str, tokens), "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no arm has runs of two model sizes" in err and "left out: t1 (its last finite" in err
