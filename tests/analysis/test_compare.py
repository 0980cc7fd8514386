"""``kvtrain compare``: the report and plots of two real tiny runs (the session's
vanilla / KV-shift arms), and its arithmetic on synthetic runs whose
``metrics.jsonl`` has the trainer's record shapes (train records with
consumed tokens, validation records without, kv_shift statistics records)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvtrain.analysis.compare import compare, tokens_to_reach
from kvtrain.analysis.runs import Curve
from kvtrain.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_report_of_the_two_arms(arm_runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["compare", str(arm_runs["vanilla"]), str(arm_runs["kv_shift"]),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    vanilla, shifted = summary["runs"]
    assert summary["reference"] == "vanilla" and shifted["attention"] == "kv_shift"
    for run, entry in ((arm_runs["vanilla"], vanilla), (arm_runs["kv_shift"], shifted)):
        assert entry["val_loss"] == records(run, "valid")[-1]["val_loss"]
        assert entry["train_loss"] == records(run, "train")[-1]["lm_loss"]
        assert entry["tokens"] == records(run, "train")[-1]["consumed_tokens"]
    vs = shifted["vs_reference"]
    assert vs["val_loss_diff"] == pytest.approx(shifted["val_loss"] - vanilla["val_loss"])
    assert vs["target_loss"] == vanilla["val_loss"]
    # Table 5 quadrants over 2 layers x 2 KV heads, and every head's coefficients
    shift = shifted["kv_shift"]
    assert vanilla["kv_shift"] is None and sum(shift["quadrants"].values()) == 4
    last = records(arm_runs["kv_shift"], "kv_shift")[-1]
    assert shift["heads"] == last["kv_shift/coefficients"]
    assert [len(shift["heads"][layer]["alpha"]) for layer in ("01", "02")] == [2, 2]
    report = (out / "report.md").read_text()
    for png in ("loss.png", "loss_difference.png", "kv_shift_coefficients.png"):
        assert (out / png).read_bytes()[:8] == PNG and f"]({png})" in report
    assert "| α1 > α2 |" in report and "| kv_shift | kv_shift | 8 |" in report
    assert f"report: {out / 'report.md'}" in printed and "Table 5 quadrants" in printed
    assert "differs from A" not in printed  # the arms differ in model.attention only


def _write_run(folder: Path, val: list[tuple[int, float]], train_loss=5.0, evals=None) -> Path:
    """A run folder with the trainer's record shapes: 256 tokens per iteration."""
    folder.mkdir(parents=True)
    cfg = {"model": {"attention": "kv_shift"}, "train": {"global_batch_size": 8, "seq_length": 32}}
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [{"kind": "event", "iteration": 0, "message": "backend torch", "time": 1.0}]
    for it in range(10, 110, 10):
        lines.append({"kind": "train", "iteration": it, "consumed_samples": 8 * it,
                      "consumed_tokens": 256 * it, "lm_loss": train_loss - it / 100, "lr": 1e-3,
                      "grad_norm": 1.0, "time": 2.0})
    lines += [{"kind": "valid", "iteration": it, "val_loss": loss, "val_ppl": 1.0,
               "val_tokens": 512, "time": 3.0} for it, loss in val]
    text = "\n".join(json.dumps(r) for r in lines) + "\n{\"kind\": \"train\", \"itera"  # cut line
    (folder / "metrics.jsonl").write_text(text)
    if evals is not None:
        (folder / "eval").mkdir()
        for name, content in evals.items():
            (folder / "eval" / name).write_text(content)
    return folder


def test_speedup_difference_and_evals(tmp_path):
    a = _write_run(tmp_path / "a", [(50, 3.0), (100, 2.0)],
                   evals={"lambada.json": json.dumps({"tasks": {"lambada": {"acc": 0.25,
                                                                            "note": "x"}}}),
                          "broken.json": "{not json"})
    # B reaches 2.0 half-way between iterations 60 (2.5) and 80 (1.5): iteration 70
    b = _write_run(tmp_path / "b", [(20, 3.5), (60, 2.5), (80, 1.5), (100, 1.2)],
                   train_loss=4.5,
                   evals={"all.json": json.dumps({"tasks": {"lambada": {"acc": 0.5},
                                                            "arc_easy": {"acc_norm": 0.75}}})})
    c = _write_run(tmp_path / "c", [(50, 3.2), (100, 2.1)])  # never gets to 2.0
    summary, printed = compare([a, b, c], tmp_path / "out")
    _, rb, rc = summary["runs"]
    assert rb["vs_reference"]["b_tokens"] == pytest.approx(70 * 256)
    assert rb["vs_reference"]["speedup"] == pytest.approx(100 / 70)
    assert rb["vs_reference"]["train_loss_diff"] == pytest.approx(-0.5)
    assert rc["vs_reference"]["speedup"] is None and "not reached" in printed
    assert "1.43x" in printed
    report = (tmp_path / "out" / "report.md").read_text()
    # records without settings (iteration, shots, limit): one setting, all unknown
    assert "| lambada | - | - | - | - | - | acc | 0.2500 | 0.5000 | - |" in report
    assert "| arc_easy | - | - | - | - | - | acc_norm | - | 0.7500 | - |" in report
    assert "broken.json: not read" in report and "line(s) are not JSON records" in report
    assert not (tmp_path / "out" / "kv_shift_coefficients.png").exists()  # no kv_shift records


def _eval_record(acc: float, shots=None, limit=None, iteration=100, dtype=None) -> str:
    """A results file as ``kvtrain eval`` writes it (``report.make_record``; without
    a dtype as in a record that names none: fp32)."""
    config = {"num_fewshot": shots, "limit": limit, **({"dtype": dtype} if dtype else {})}
    return json.dumps({"iteration": iteration, "tasks": {"lambada": {"acc": acc}},
                       "n_shot": {"lambada": shots or 0}, "config": config})


def test_eval_rows_keep_settings_apart(tmp_path):
    """A result sits only in the row of its own setting (checkpoint iteration, shots
    (the task's own, as lm-eval reports them, when not given), limit, dtype): A's
    0-shot accuracy is never shown next to B's 5-shot one, nor bf16 next to fp32."""
    a = _write_run(tmp_path / "a", [(100, 2.0)], evals={
        "lambada-iter_0000100-5shot.json": _eval_record(0.60, 5),
        "lambada-iter_0000100.json": _eval_record(0.30),
        "lambada-iter_0000050.json": _eval_record(0.20, iteration=50)})
    b = _write_run(tmp_path / "b", [(100, 1.9)], evals={
        "lambada-iter_0000100-5shot.json": _eval_record(0.50, 5),
        "lambada-iter_0000100-0shot.json": _eval_record(0.35, 0),
        "lambada-iter_0000100-limit200.json": _eval_record(0.40, limit=200),
        "lambada-iter_0000100-bf16.json": _eval_record(0.45, dtype="bf16"),
        "lambada-iter_0000100-5shot-bf16.json": _eval_record(0.55, 5, dtype="bf16")})
    summary, _ = compare([a, b], tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| task | iteration | shots | limit | dtype | window | metric | a | b |" in report
    assert [line for line in report.splitlines() if line.startswith("| lambada |")] == [
        "| lambada | 50 | 0 | - | fp32 | - | acc | 0.2000 | - |",
        "| lambada | 100 | 0 | - | bf16 | - | acc | - | 0.4500 |",
        "| lambada | 100 | 0 | - | fp32 | - | acc | 0.3000 | 0.3500 |",
        "| lambada | 100 | 0 | 200 | fp32 | - | acc | - | 0.4000 |",
        "| lambada | 100 | 5 | - | bf16 | - | acc | - | 0.5500 |",
        "| lambada | 100 | 5 | - | fp32 | - | acc | 0.6000 | 0.5000 |"]
    assert {"task": "lambada", "iteration": 100, "num_fewshot": 5, "limit": None,
            "dtype": "fp32", "max_length": None, "metrics": {"acc": 0.5}} \
        in summary["runs"][1]["eval"]


def test_eval_rows_keep_windows_apart(tmp_path):
    """``kvtrain eval --max-length`` scores within another window (its file named
    ``-lenL``): its results were merged into the default's row, a later file's
    metric replacing the other's. The window a record names is part of its setting;
    a record of an older kvtrain names none (``-``)."""
    def record(acc, window):
        return json.dumps({**json.loads(_eval_record(acc)),
                           **({"max_length": window} if window else {})})

    a = _write_run(tmp_path / "a", [(100, 2.0)], evals={
        "lambada-iter_0000100.json": record(0.30, 32),
        "lambada-iter_0000100-len64.json": record(0.25, 64)})
    b = _write_run(tmp_path / "b", [(100, 1.9)], evals={
        "lambada-iter_0000100.json": record(0.35, 32), "old.json": record(0.10, None)})
    compare([a, b], tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| task | iteration | shots | limit | dtype | window | metric | a | b |" in report
    assert [line for line in report.splitlines() if line.startswith("| lambada |")] == [
        "| lambada | 100 | 0 | - | fp32 | - | acc | - | 0.1000 |",
        "| lambada | 100 | 0 | - | fp32 | 32 | acc | 0.3000 | 0.3500 |",
        "| lambada | 100 | 0 | - | fp32 | 64 | acc | 0.2500 | - |"]


def test_eval_differences_say_whether_they_are_beyond_the_noise(tmp_path):
    """Each run's metric minus A's, in the same setting, with a 95 % interval from the
    two stderrs lm-eval reports (unpaired: wider than a paired test of the same
    documents) and whether the difference lies beyond it; a metric without a
    stderr (perplexity's bootstrap off) or a setting A lacks has no row."""
    def record(acc, se, ppl):
        metrics = {"acc": acc, "acc_stderr": se, "perplexity": ppl}
        return json.dumps({"iteration": 100, "tasks": {"arc": metrics}, "n_shot": {"arc": 0},
                           "config": {"num_fewshot": None, "limit": None}})

    a = _write_run(tmp_path / "a", [(100, 2.0)], evals={"arc-iter_0000100.json":
                                                        record(0.30, 0.02, 9.0)})
    b = _write_run(tmp_path / "b", [(100, 1.9)], evals={"arc-iter_0000100.json":
                                                        record(0.36, 0.02, 8.0)})
    c = _write_run(tmp_path / "c", [(100, 1.9)], evals={
        "arc-iter_0000100.json": record(0.33, 0.02, 8.5),
        "arc-iter_0000100-5shot.json": record(0.5, 0.02, 7.0).replace('"arc": 0}', '"arc": 5}')})
    summary, _ = compare([a, b, c], tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| task | iteration | shots | limit | dtype | window | metric | run | run - A | " \
           "95 % interval | beyond it |" in report
    rows = [line for line in report.splitlines() if line.startswith("| arc |")
            and line.count("|") == 12]
    assert rows == ["| arc | 100 | 0 | - | fp32 | - | acc | b | +0.0600 | ±0.0554 | yes |",
                    "| arc | 100 | 0 | - | fp32 | - | acc | c | +0.0300 | ±0.0554 | no |"]
    (vs,) = summary["runs"][1]["eval_vs_reference"]
    assert vs["metric"] == "acc" and vs["diff"] == pytest.approx(0.06)
    assert vs["interval95"] == pytest.approx(1.959964 * (2 * 0.02 ** 2) ** 0.5, rel=1e-6)


def test_eval_shots_are_those_lm_eval_ran():
    """A task whose YAML fixes ``num_fewshot: 0`` (bbh_zeroshot, ifeval, ...) runs
    0-shot whatever ``--num-fewshot`` says (lm-eval ignores it): its results sit
    in the 0-shot row, not in the row of the shots asked for."""
    from kvtrain.analysis.runs import eval_setting

    record = {"iteration": 100, "tasks": {"bbh": {"acc": 0.1}}, "n_shot": {"bbh": 0},
              "config": {"num_fewshot": 3, "limit": None, "dtype": "fp32"}}
    assert eval_setting(record, "bbh")["num_fewshot"] == 0
    # a group lm-eval reports no shots for: the shots asked for
    assert eval_setting(record, "bbh_group")["num_fewshot"] == 3


def test_tokens_to_reach():
    curve = Curve([1, 2, 3], [100.0, 200.0, 300.0], [4.0, 3.0, 2.0])
    assert tokens_to_reach(curve, 4.5) == 100.0
    assert tokens_to_reach(curve, 2.5) == pytest.approx(250.0)
    assert tokens_to_reach(curve, 1.9) is None


def test_default_out_is_next_to_the_runs(tmp_path, capsys):
    runs = [_write_run(tmp_path / "exp" / name, [(100, 2.0)]) for name in ("x", "y")]
    assert main(["compare", *map(str, runs)]) == 0
    assert (tmp_path / "exp" / "compare" / "report.md").is_file()


@pytest.mark.parametrize("setup,message", [
    (lambda d: None, "{d}/missing: no such run folder"),
    # a file there: "no such run folder" said it was not there (a probe's)
    (lambda d: (d / "missing").write_text("x"), "{d}/missing is a file, not a run folder"),
    (lambda d: (d / "missing").mkdir(), "{d}/missing is not a kvtrain run folder (no metrics.jsonl)"),
    (lambda d: ((d / "missing").mkdir(), (d / "missing" / "metrics.jsonl").write_text(
        '{"kind": "event", "iteration": 0}\n')),
     "{d}/missing/metrics.jsonl has no train records with a loss"),
])
def test_bad_run_folder_is_one_line(tmp_path, capsys, setup, message):
    good = _write_run(tmp_path / "good", [(100, 2.0)])
    setup(tmp_path)
    assert main(["compare", str(good), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvtrain: config error: " + message.format(d=tmp_path)


def test_one_run_is_one_line(tmp_path, capsys):
    good = _write_run(tmp_path / "good", [(100, 2.0)])
    assert main(["compare", str(good)]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvtrain: config error: kvtrain compare needs at least two run folders")


def test_a_run_without_validation_records_is_not_called_slower(tmp_path):
    """B has train records only (eval off): its speed-up is unknown, not "not reached"."""
    a = _write_run(tmp_path / "a", [(50, 3.0), (100, 2.0)])
    b = _write_run(tmp_path / "b", [])
    summary, printed = compare([a, b], tmp_path / "out")
    assert summary["runs"][1]["vs_reference"]["speedup"] is None
    assert "not reached" not in printed and "no validation curve" in printed
    assert "not reached" not in (tmp_path / "out" / "report.md").read_text()


def test_a_run_against_a_copy_of_itself_is_1x_on_a_non_monotone_curve(tmp_path):
    """A's validation loss already touched its final value at iteration 20: its
    tokens to reach it are read by the same rule as B's (first crossing), so a
    copy of A is 1.00x, not A's last tokens over B's first crossing (5x)."""
    val = [(20, 2.0), (40, 3.0), (60, 2.5), (100, 2.0)]
    a, b = _write_run(tmp_path / "a", val), _write_run(tmp_path / "b", val)
    summary, printed = compare([a, b], tmp_path / "out")
    vs = summary["runs"][1]["vs_reference"]
    assert vs["a_tokens"] == vs["b_tokens"] == pytest.approx(20 * 256)
    assert vs["speedup"] == pytest.approx(1.0) and "1.00x" in printed


def test_a_run_below_at_its_first_validation_gives_a_lower_bound(tmp_path):
    """B's first validation (iteration 50) is already below A's final loss: B got
    there at some point up to 50 iterations, unseen, so 100/50 = 2x is the least
    speed-up, not a measured one; runs validated only at their end (eval_interval =
    max_steps) were 1.00x however much lower B ended."""
    a = _write_run(tmp_path / "a", [(50, 3.0), (100, 2.0)])
    b = _write_run(tmp_path / "b", [(50, 1.9), (100, 1.5)])
    summary, printed = compare([a, b], tmp_path / "out")
    said = "12.80k tokens or fewer vs 25.60k: at least 2.00x (at B's first validation)"
    assert said in printed and said in (tmp_path / "out" / "report.md").read_text(), printed
    vs = summary["runs"][1]["vs_reference"]
    assert vs["speedup"] == pytest.approx(2.0) and vs["speedup_at_least"]
    once_a = _write_run(tmp_path / "a1", [(100, 2.0)])
    once_b = _write_run(tmp_path / "b1", [(100, 1.0)])
    summary, printed = compare([once_a, once_b], tmp_path / "out1")
    assert "25.60k tokens or fewer vs 25.60k: at least 1.00x" in printed
    # crossed between two validations: measured (linear in between), no bound
    c = _write_run(tmp_path / "c", [(50, 2.5), (100, 1.5)])
    summary, printed = compare([a, c], tmp_path / "out2")
    assert not summary["runs"][1]["vs_reference"]["speedup_at_least"]
    assert "19.20k tokens vs 25.60k: 1.33x" in printed


def test_a_diverged_run_says_so(tmp_path):
    """B's last validation loss is NaN (the trainer writes "nan"): the curve stops
    at its last finite point, and the report and the printed summary say why
    instead of showing that point as B's final loss unremarked."""
    a = _write_run(tmp_path / "a", [(50, 3.0), (100, 2.0)])
    b = _write_run(tmp_path / "b", [(50, 3.0), (100, "nan")])
    summary, printed = compare([a, b], tmp_path / "out")
    note = f"{b / 'metrics.jsonl'}: val_loss not finite in 1 valid record(s), first at iteration 100"
    assert any(n.startswith(note) for n in summary["runs"][1]["notes"])
    assert note in printed and note in (tmp_path / "out" / "report.md").read_text()
    assert not summary["runs"][0]["notes"][1:]  # A: only the cut line


def test_a_diverged_reference_is_named_not_b(tmp_path):
    """A (the reference) has only a NaN validation loss: B's speed-up and B - A cannot
    be computed, and the report says A diverged, not that B has no validation curve
    (B's own numbers stay); so for a named set A diverged on."""
    a = _write_run(tmp_path / "a", [(100, "nan")])
    b = _write_run(tmp_path / "b", [(50, 3.0), (100, 2.0)])
    for path in (a, b):  # the same set: A's NaN, B's finite
        with (path / "metrics.jsonl").open("a") as f:
            f.write("\n" + json.dumps({"kind": "valid", "iteration": 100, "set": "wiki",
                                       "val_loss": "nan" if path == a else 2.5}) + "\n")
    summary, printed = compare([a, b], tmp_path / "out")
    rb = summary["runs"][1]
    assert rb["val_loss"] == 2.0 and rb["vs_reference"]["speedup"] is None
    text = ("A = a has no finite final validation loss (not finite from iteration 100: "
            "diverged?): no speed-up or difference against it")
    assert f"val 2.0000  (val - A -; to reach A: {text})" in printed, printed
    assert f"set wiki: val 2.5000  (val - A -; to reach A: {text})" in printed, printed
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"| - | {text} |" in report and "no validation curve" not in report + printed


def test_a_run_with_records_lost_says_which(tmp_path):
    """Train records a full disk never took (the trainer names them in a log, or in
    an event at the next start): the curve passed straight over the gap, unremarked."""
    a = _write_run(tmp_path / "a", [(100, 2.0)])
    b = _write_run(tmp_path / "b", [(100, 2.0)])
    path = b / "metrics.jsonl"
    kept = [r for r in map(json.loads, path.read_text().splitlines()[:-1])
            if r["iteration"] not in (40, 50, 60)]
    path.write_text("".join(json.dumps({**r, "steps_in_window": 10}) + "\n" for r in kept))
    summary, printed = compare([a, b], tmp_path / "out")
    note = (f"{path}: no train records of iterations 31-60, which were trained (their "
            "records were not written): the curve passes over them")
    assert summary["runs"][1]["notes"] == [note] and note in printed
    assert not summary["runs"][0]["notes"][1:]  # A (no windows written): only the cut line


def test_a_history_recorded_twice_reads_its_later_records(tmp_path):
    """A metrics.jsonl whose iterations go back (two files concatenated, a restart
    from an earlier checkpoint that kept the records after it: the trainer itself
    cuts them at every start): the stale records 60-100 were read beside the later
    ones, the curves zigzagged and B's speed-up came from the stale points (2.50x).
    The later history wins, as in the trainer, with a note."""
    a = _write_run(tmp_path / "a", [(50, 3.0), (100, 2.0)])
    b = _write_run(tmp_path / "b", [(50, 3.0), (60, 1.9), (100, 1.5)])
    path = b / "metrics.jsonl"
    stale = [json.loads(x) for x in path.read_text().splitlines()[:-1]]
    later = [{**r, "lm_loss": r["lm_loss"] + 1.0} if r["kind"] == "train" else
             {**r, "val_loss": r["val_loss"] + 0.4} for r in stale
             if r["kind"] in ("train", "valid") and r["iteration"] >= 60]
    path.write_text("".join(json.dumps(r) + "\n" for r in stale + later))
    summary, printed = compare([a, b], tmp_path / "out")
    run = summary["runs"][1]
    assert run["val_loss"] == pytest.approx(1.9)  # the later history's
    # 2.0 reached between the later records of 60 (2.3) and 100 (1.9): at 90
    assert run["vs_reference"]["b_tokens"] == pytest.approx(90 * 256)
    assert run["notes"] == [f"{path}: iterations 60-100 are recorded twice (the history "
                            "goes back to 60): the later records are read"], run["notes"]


def test_runs_whose_curves_are_over_other_batches_say_so(tmp_path):
    """The same training validated on 4 batches instead of 2 read as 0.015 lower and a
    1.02x speed-up, unremarked; a train loss logged over 5 steps, not 1, likewise."""
    a = _write_run(tmp_path / "a", [(100, 2.0)])
    b = _write_run(tmp_path / "b", [(100, 1.98)])
    for run, (evals, log) in ((a, (2, 1)), (b, (4, 5))):
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["train"].update(eval_iters=evals, log_interval=log)
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary, _ = compare([a, b], tmp_path / "out")
    assert summary["runs"][1]["notes"][0] == (
        "differs from A beyond model.attention: train.eval_iters: 2 -> 4; train.log_interval: "
        "1 -> 5 (the losses compare more than the attention)")


def test_the_same_run_twice_is_one_line(tmp_path, capsys):
    """A run folder named twice (as itself, or through a link to it) would be
    two identically labelled runs in the report and its plots: refused."""
    a = _write_run(tmp_path / "a", [(100, 2.0)])
    b = _write_run(tmp_path / "b", [(100, 2.0)])
    (tmp_path / "link").symlink_to(a)
    for again in (a, tmp_path / "link"):
        assert main(["compare", str(a), str(b), str(again)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"kvtrain: config error: run folder {a.resolve()} is given twice: name each run once")
    assert not (tmp_path / "compare").exists()


def test_a_report_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    """--out under a file, or the default compare/ next to the runs being a file:
    one line naming the folder (and --out only when the user gave it), nothing
    written. The default one was blamed on an --out the user never gave."""
    runs = [str(_write_run(tmp_path / name, [(100, 2.0)])) for name in ("a", "b")]
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "report"
    assert main(["compare", *runs, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"kvtrain: config error: --out {out}: cannot create it "
                                       "(Not a directory)\n")
    (tmp_path / "compare").write_text("x")  # the default report folder's name, taken
    assert main(["compare", *runs]) == 2
    assert capsys.readouterr().err == (
        f"kvtrain: config error: {tmp_path / 'compare'}: cannot create the report folder "
        "(File exists): name another with --out\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "afile", "b", "compare"]
    assert (tmp_path / "compare").read_text() == "x"


def test_records_of_older_or_damaged_shapes_are_read_or_noted(tmp_path, capsys, recwarn):
    """Runs of one folder name in two experiments (labelled by their parents, the
    report next to both); B's records as an older trainer wrote them (train records
    without consumed tokens, a validation after the last train record, layer means
    without per-head coefficients) among lines that are not records, and eval files
    without a tasks mapping or with a task that is not one: read where they can be,
    each dropped line or file noted. A has no validation curve: nothing is called
    faster or slower."""
    a = _write_run(tmp_path / "x" / "run", [])
    b = tmp_path / "y" / "run"
    b.mkdir(parents=True)
    (b / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"attention": "kv_shift"}, "train": {"global_batch_size": 2, "seq_length": 4}}))
    lines = [{"kind": "train", "iteration": 1, "lm_loss": 5.0},
             {"kind": "train", "iteration": 2, "lm_loss": 4.0},
             {"kind": "valid", "iteration": 3, "val_loss": 3.5},
             {"kind": "kv_shift", "iteration": 2, "kv_shift/layer_01/alpha1": 0.9,
              "kv_shift/layer_01/alpha2": 0.1}]
    (b / "metrics.jsonl").write_text("\n[1, 2]\n" + "\n".join(map(json.dumps, lines)) + "\n")
    (b / "eval").mkdir()
    (b / "eval" / "old.json").write_text(json.dumps({"results": {"arc": {"acc": 0.5}}}))
    (b / "eval" / "new.json").write_text(json.dumps({"tasks": {"lambada": 0.5,
                                                              "arc": {"acc": 0.25}}}))
    assert main(["compare", str(a), str(b)]) == 0
    printed = capsys.readouterr().out
    # no token range in common: an empty difference plot, without matplotlib's
    # "No artists with labels found to put in legend" on stderr
    assert [str(w.message) for w in recwarn if w.filename.endswith("plots.py")] == []
    out = tmp_path / "compare"  # the runs' common parent folder
    summary = json.loads((out / "summary.json").read_text())
    ra, rb = summary["runs"]
    assert (ra["label"], rb["label"]) == ("x/run", "y/run")
    assert (rb["tokens"], rb["train_loss"], rb["val_loss"]) == (16, 4.0, 3.5)  # 2 x 4 per step
    assert rb["vs_reference"]["a_tokens"] is None and rb["vs_reference"]["speedup"] is None
    assert rb["notes"] == ["differs from A beyond model.attention: train.global_batch_size: "
                           "8 -> 2; train.seq_length: 32 -> 4 (the losses compare more than the "
                           "attention)",
                           f"{b / 'metrics.jsonl'}: 1 line(s) are not JSON records (skipped)",
                           f"{b / 'eval' / 'old.json'}: no \"tasks\" mapping"]
    assert [(e["task"], e["metrics"]) for e in rb["eval"]] == [("arc", {"acc": 0.25})]
    assert "  y/run                kv_shift        16 tokens  train 4.0000  val 3.5000  (val - " \
           "A -; to reach A: no validation curve)" in printed, printed
    report = (out / "report.md").read_text()
    assert "| y/run | kv_shift | 2 | 16 | 4.0000 | 3.5000 | 33.12 | - | no validation curve |" \
        in report, report
    assert "| 01 | 0.900 | 0.100 |" in report
    assert (out / "kv_shift_coefficients.png").read_bytes()[:8] == PNG  # from the layer means
    from kvtrain.analysis.runs import read_run

    valid = read_run(b).valid  # at 3 x 8 tokens: after the last train record, from the config
    assert (valid.iterations, valid.tokens) == ([3], [24.0])


def test_without_matplotlib_is_one_line_keeping_an_earlier_report(tmp_path, capsys, monkeypatch):
    """kvtrain compare on an install without matplotlib (not the dev extra): one line
    naming what to install; the report already in --out is left as it was."""
    import sys

    runs = [str(_write_run(tmp_path / name, [(100, 2.0)])) for name in ("a", "b")]
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("earlier report\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["compare", *runs, "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("kvtrain: config error: kvtrain compare draws with "
                                       "matplotlib, which is not installed: pip install -e "
                                       "'.[dev]'\n")
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]
    assert (out / "report.md").read_text() == "earlier report\n"


def test_a_run_that_differs_beyond_the_attention_says_how(tmp_path, capsys):
    """The paper's comparison holds everything but the attention: a B trained on
    another vocabulary, learning rate or seed is named, in the printed summary and the
    report, so a "speed-up" of another setting is not taken for KV shifting's."""
    a = _write_run(tmp_path / "a", [(50, 3.0), (100, 2.0)])
    b = _write_run(tmp_path / "b", [(50, 2.9), (100, 1.9)])
    c = _write_run(tmp_path / "c", [(50, 2.9), (100, 1.9)])
    base = yaml.safe_load((a / "config.yaml").read_text())
    base["model"].update(vocab_size=256, attention="vanilla", backend="local")
    base.update(optimizer={"lr": 0.001}, data={"num_workers": 2, "seed": 1})
    (a / "config.yaml").write_text(yaml.safe_dump(base))
    same = {**base, "model": {**base["model"], "attention": "kv_shift", "backend": "torch",
                              "kv_shift": {"window": 1}}, "data": {"num_workers": 0, "seed": 1}}
    (c / "config.yaml").write_text(yaml.safe_dump(same))
    other = {**same, "model": {**same["model"], "vocab_size": 300}, "optimizer": {"lr": 0.002},
             "train": {**base["train"], "seed": 7}}
    (b / "config.yaml").write_text(yaml.safe_dump(other))
    assert main(["compare", str(a), str(b), str(c), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    note = ("note: differs from A beyond model.attention: model.vocab_size: 256 -> 300; "
            "optimizer.lr: 0.001 -> 0.002; train.seed: None -> 7 (the losses compare more "
            "than the attention)")
    assert printed.count("differs from A") == 1 and note in printed, printed
    assert note[len("note: "):] in (tmp_path / "out" / "report.md").read_text()


def test_a_full_disk_is_one_line_keeping_an_earlier_report(tmp_path, capsys):
    """kvtrain compare onto a full disk (a quota): one line naming the file; the
    report already in --out is left whole (each file is renamed in whole)."""
    from tests.hf.test_hf_refusals import small_files

    runs = [str(_write_run(tmp_path / name, [(100, 2.0), (200, 1.5)])) for name in ("a", "b")]
    out = tmp_path / "out"
    assert main(["compare", *runs, "--out", str(out)]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with small_files(64):
        assert main(["compare", *runs, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvtrain: output error: writing {out}/") \
        and err[0].endswith(" failed: File too large; what was there before is kept"), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_validation_after_the_last_train_record_counts_from_its_tokens(tmp_path):
    """A running (or crashed) run's last validation can come after its last train
    record; its tokens were iteration x the config's tokens per iteration, wrong for a
    run resumed at another global batch (10 steps at 8 x 32, then 16 x 32: iteration
    21 read 10752 tokens for 8192). They go on from the last consumed tokens now. A
    config whose ``train`` is not a mapping (a hand edit) was an AttributeError."""
    from kvtrain.analysis.runs import read_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"attention": "kv_shift"}, "train": {"global_batch_size": 16, "seq_length": 32}}))
    lines = [{"kind": "train", "iteration": 10, "consumed_tokens": 2560, "lm_loss": 5.0},
             {"kind": "train", "iteration": 20, "consumed_tokens": 7680, "lm_loss": 4.0},
             {"kind": "valid", "iteration": 21, "val_loss": 3.9}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert read_run(run).valid.tokens == [8192.0]
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"attention": "kv_shift"},
                                                     "train": [1, 2]}))
    assert read_run(run).valid.tokens == []  # no tokens per iteration to go on with
