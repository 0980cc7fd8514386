"""``kvtrain experiment induction``: a generator of ``kvtrain train`` run
configs, one per arm, trained by the trainer. The configs, the ``--set``
grammar (kvtrain train's), the refusals, the curve read from metrics.jsonl,
and one tiny grid end to end (results.csv, accuracy.png, loss.png,
summary.json)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvtrain.cli import main
from kvtrain.config import ConfigError, dump_yaml, to_dict
from kvtrain.experiments.presets import arm_configs, preset_arms
from kvtrain.experiments.results import curve_from_metrics
from kvtrain.experiments.runner import arm_jobs, earlier_group
from tests.hf.test_hf_refusals import small_files

PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["train.max_steps=4", "train.eval_interval=2", "train.log_interval=2",
        "train.eval_iters=1", "train.global_batch_size=4", "train.micro_batch_size=2",
        "train.seq_length=32", "model.vocab_size=128", "model.hidden_size=16",
        "optimizer.lr_warmup_steps=2", "data.induction.max_val=128"]


def without_arm_keys(cfg) -> dict:
    d = to_dict(cfg)
    d.pop("name")
    d["model"].pop("attention")
    d["model"].pop("num_layers")
    return d


@pytest.mark.parametrize("preset", ["fig1a", "fig1b", "ngram", "fig8"])
@pytest.mark.parametrize("scale", ["cpu", "paper"])
def test_every_arm_is_a_validated_run_config_differing_only_in_its_keys(preset, scale):
    configs = arm_configs(preset, scale)
    assert [a.name for a, _ in configs] == [a.name for a in preset_arms(preset, scale)]
    if preset == "fig8":  # Figure 8's result is at L = 5 (Sanford et al. train 2..6 layers)
        depths = sorted({cfg.model.num_layers for _, cfg in configs})
        assert depths == ([2, 3, 4] if scale == "cpu" else [2, 3, 4, 5, 6]), depths
    shared = without_arm_keys(configs[0][1])
    for arm, cfg in configs:
        assert (cfg.model.attention, cfg.model.num_layers, cfg.name) == \
            (arm.attention, arm.num_layers, arm.name)
        assert without_arm_keys(cfg) == shared  # same seed, data, optimizer, width
    # an arm rerun into its folder resumes from its checkpoints (the paper scale saves some)
    assert shared["checkpoint"]["resume"] == "auto"
    saves = {"paper": 5000 if preset == "fig8" else 1000, "cpu": None}[scale]
    assert shared["checkpoint"]["save_interval"] == saves
    assert shared["data"]["type"] == {"ngram": "ngram", "fig8": "hop"}.get(preset, "induction")


def test_preset_values():
    paper = arm_configs("fig1a", "paper")[0][1]
    assert (paper.model.hidden_size, paper.model.vocab_size, paper.train.seq_length) == \
        (1024, 8000, 512)
    assert (paper.optimizer.lr, paper.optimizer.lr_warmup_steps) == (2e-4, 1000)
    assert paper.train.global_batch_size == 4096 and paper.optimizer.lr_schedule == "constant"
    cpu = arm_configs("fig1a", "cpu")[0][1]
    assert (cpu.model.hidden_size, cpu.train.max_steps, cpu.optimizer.lr) == (64, 1200, 3e-3)
    assert cpu.train.eval_iters * cpu.train.global_batch_size == 256
    fig1b = arm_configs("fig1b", "cpu")[0][1]
    assert fig1b.model.hidden_size == 8 and fig1b.data.induction.variant == "strict"
    ngram = arm_configs("ngram", "cpu")[0][1]
    assert (ngram.data.ngram.num_pairs, ngram.train.seq_length) == (200, 96)
    # Figure 8: Sanford et al.'s k-hop setting (their code's defaults), 2-6 layers
    hop = arm_configs("fig8", "paper")
    assert [a.name for a, _ in hop] == [f"{attention}-{n}L" for n in range(2, 7)
                                        for attention in ("kv_shift", "vanilla")]
    h = hop[0][1]
    assert (h.data.hop.alphabet, h.data.hop.min_hops, h.data.hop.max_hops) == (4, 0, 16)
    assert (h.model.hidden_size, h.model.num_attention_heads, h.train.seq_length) == (128, 4, 100)
    assert (h.train.global_batch_size, h.train.max_steps, h.optimizer.lr) == (32, 100_000, 1e-4)
    assert (h.optimizer.lr_schedule, h.optimizer.wsd_decay_steps, h.optimizer.min_lr) == \
        ("wsd", 99_000, 0.0)
    assert arm_configs("fig8", "cpu")[0][1].data.hop.max_hops == 8


def test_set_is_kvtrain_trains_grammar_and_applies_to_every_arm():
    configs = arm_configs("fig1a", "cpu", ["model.hidden_size=32", "data.induction.length=64",
                                           "train.max_steps=100", "optimizer.lr=1e-3"],
                          arms=["kv_shift-1L", "vanilla-2L"])
    assert [a.name for a, _ in configs] == ["kv_shift-1L", "vanilla-2L"]
    for _, cfg in configs:
        assert cfg.model.hidden_size == 32 and cfg.data.induction.length == 64
        assert cfg.train.max_steps == 100 and cfg.optimizer.lr == 1e-3


@pytest.mark.parametrize("args, message", [
    (["--set", "train.max_step=3"], "unknown key 'train.max_step' (did you mean 'train.max_steps'?)"),
    (["--set", "model.num_layers=3"], "--set model.num_layers: model.num_layers is set by each arm"),
    (["--set", "model={}"], "--set model: model.attention is set by each arm"),
    (["--set", "data.induction.max_val=99999"],
     "data.induction.max_val (99999) exceeds model.vocab_size (1024)"),
    (["--arms", "nope"], "--arms: unknown arm(s) ['nope']"),
    (["--arms", ","], "--arms ',': no arm names"),  # it ran every arm
    (["--set", "data.type=mock"], "data.type 'mock': kvtrain experiment induction trains the toy"),
    (["--workers", "0"], "--workers and --nproc must be >= 1, --threads >= 0"),
    (["--nproc", "-1"], "--workers and --nproc must be >= 1, --threads >= 0"),
    (["--threads", "-2"], "--workers and --nproc must be >= 1, --threads >= 0"),
    # every arm saved into (and resumed from) the same folder: an arm's checkpoints
    # overwritten by another's, a resume refused after the earlier arms had trained
    (["--set", "checkpoint.dir=/scratch/fig1a"],
     "checkpoint.dir /scratch/fig1a is one folder for every arm of the experiment"),
    (["--set", "checkpoint.dir=~/fig1a"],
     "checkpoint.dir ~/fig1a is one folder for every arm of the experiment"),
])
def test_bad_options_are_one_line_errors(args, message, capsys, tmp_path):
    run_dir = tmp_path / "x"
    assert main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(run_dir),
                 *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not run_dir.exists()  # refused before anything is written


def test_curve_from_metrics(tmp_path):
    records = [
        {"kind": "train", "iteration": 2, "lm_loss": 5.0, "lr": 0.1, "time": 101.0},
        {"kind": "valid", "iteration": 2, "val_loss": 4.5, "val_acc_induction_first": 0.25,
         "val_acc_induction_all": 0.5, "time": 102.0},
        {"kind": "kv_shift", "iteration": 2, "time": 102.5},
        {"kind": "train", "iteration": 4, "lm_loss": 4.0, "lr": 0.2, "time": 103.0},
        {"kind": "valid", "iteration": 4, "val_loss": 3.5, "val_acc_induction_first": 1.0,
         "val_acc_induction_all": 0.75, "time": 104.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = curve_from_metrics(path, "arm", "induction", starts=[100.0])
    assert [(r["step"], r["accuracy"], r["accuracy_all"], r["loss"], r["train_loss"], r["lr"],
             r["elapsed_s"]) for r in rows] == [(2, 0.25, 0.5, 4.5, 5.0, 0.1, 2.0),
                                                 (4, 1.0, 0.75, 3.5, 4.0, 0.2, 4.0)]


def test_arms_of_one_shape_start_from_the_same_weights(mp1):
    """KV shift 1L and vanilla 1L built from their run configs as the trainer
    builds them (seed train.seed): identical weights, KV-shift coefficients aside."""
    from kvtrain.backend import set_seed
    from kvtrain.model.builder import build_gpt, transformer_config

    weights = []
    for _, cfg in arm_configs("fig1a", "cpu", TINY, arms=["kv_shift-1L", "vanilla-1L"]):
        set_seed(cfg.train.seed)
        model = build_gpt(cfg.model, transformer_config(cfg.model), seed=cfg.train.seed)
        weights.append({k: v for k, v in model.state_dict().items()
                        if "shift" not in k and "_extra_state" not in k})
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert (weights[0][k] == weights[1][k]).all(), k


def check_outputs(run_dir: Path, arms: list[str], steps=(2, 4)) -> None:
    with open(run_dir / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames[:4] == ["arm", "step", "accuracy", "accuracy_all"]
    assert [(r["arm"], int(r["step"])) for r in rows] == [(a, s) for a in arms for s in steps]
    for r in rows:
        assert 0.0 <= float(r["accuracy"]) <= 1.0 and 0.0 <= float(r["accuracy_all"]) <= 1.0
        assert 0.0 < float(r["loss"]) < 20.0 and 0.0 < float(r["train_loss"]) < 20.0
    for png in ("accuracy.png", "loss.png"):
        data = (run_dir / png).read_bytes()
        assert data[:8] == PNG and len(data) > 1000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["arms"]) == arms
    for a in summary["arms"].values():
        assert a["final_step"] == steps[-1] and a["exit_code"] == 0 and a["wall_s"] > 0
        assert "steps_to_95" in a and a["non_embedding_params"] > 0


@pytest.mark.slow
def test_tiny_grid_through_kvtrain_train(tmp_path, capsys):
    """Two fig1a arms side by side, each a `kvtrain train` process; the curve
    is the trainer's validation records."""
    run_dir = tmp_path / "fig1a"
    arms = ["kv_shift-1L", "vanilla-2L"]
    sets = [x for kv in TINY for x in ("--set", kv)]
    rc = main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(run_dir),
               "--arms", ",".join(arms), "--workers", "2", "--threads", "1", "--no-wandb",
               *sets])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "steps->95%" in out and "vanilla-2L" in out
    check_outputs(run_dir, arms)
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["preset"] == "fig1a" and "wandb.enabled=false" in spec["overrides"]
    for arm, layers, attention in (("kv_shift-1L", 1, "kv_shift"), ("vanilla-2L", 2, "vanilla")):
        saved = (run_dir / "arms" / arm / "run" / "config.yaml").read_text()
        assert f"num_layers: {layers}" in saved and f"attention: {attention}" in saved
        records = [json.loads(x) for x in
                   (run_dir / "arms" / arm / "run" / "metrics.jsonl").read_text().splitlines()]
        valid = [r for r in records if r["kind"] == "valid"]
        assert [r["iteration"] for r in valid] == [2, 4]
        assert all("val_acc_induction_first" in r for r in valid)
        assert not (run_dir / "arms" / arm / "run" / "wandb").exists()
    # the same command again: both arms are finished, kept, and the results rewritten
    assert main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(run_dir),
                 "--arms", ",".join(arms), "--no-wandb", *sets]) == 0
    out = capsys.readouterr().out
    assert all(f"[{arm}] finished earlier" in out for arm in arms), out
    check_outputs(run_dir, arms)
    # a full disk as it rewrites them again: one line, and every record is whole
    # (before: spec.json cut to nothing, an OSError traceback)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    with small_files(64):
        rc = main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(run_dir),
                   "--arms", ",".join(arms), "--no-wandb", *sets])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"kvtrain: output error: writing {run_dir / 'spec.json'} failed: "
                               "File too large; what was there before is kept"], err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_a_grid_on_other_data_is_refused_before_training():
    """Only induction / 3-gram runs have the accuracy the results read: a grid on
    mock or text data would train every arm and then fail reading the first curve."""
    with pytest.raises(ConfigError, match=r"^data.type 'mock': kvtrain experiment induction "
                                          r"trains the toy tasks"):
        arm_configs("fig1a", "cpu", ["data.type=mock"])


def test_a_grid_without_validation_is_refused_before_training():
    """The curves are the validation records: without them every arm would
    train and the results be empty (NaN accuracies, never 95 %)."""
    with pytest.raises(ConfigError, match=r"^train.eval_interval null: kvtrain experiment reads "
                                          r"each arm's curve from its validation"):
        arm_configs("fig1a", "cpu", ["train.eval_interval=null"])


def fake_arm(run_dir: Path, cfg, last_step: int, exit_code: int = 0) -> None:
    """An arm's folder as the runner leaves it: arm.yaml, result.json and the
    run's metrics.jsonl, with validation records every 2 steps up to ``last_step``."""
    folder = run_dir / "arms" / cfg.name
    (folder / "run").mkdir(parents=True)
    (folder / "arm.yaml").write_text(dump_yaml(cfg))
    (folder / "result.json").write_text(json.dumps({"exit_code": exit_code, "wall_s": 7.0,
                                                    "started": 100.0}))
    records = [r for s in range(2, last_step + 1, 2) for r in (
        {"kind": "train", "iteration": s, "lm_loss": 5.5 - s / 4, "lr": 0.1, "time": 99.5 + s},
        {"kind": "valid", "iteration": s, "val_loss": 5.0 - s / 4,
         "val_acc_induction_first": s / 4, "val_acc_induction_all": s / 8, "time": 100.0 + s})]
    (folder / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


TINY_SETS = [x for kv in TINY + ["wandb.enabled=false"] for x in ("--set", kv)]


def fake_grid(run_dir: Path, finished: list[str], unfinished: list[str] = (),
              sets: list[str] = TINY, preset: str = "fig1a") -> None:
    """A grid's folder after a first ``kvtrain experiment`` (spec.json and arms)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps({"preset": preset, "scale": "cpu",
                                                   "wandb_group": "g"}))
    for arm, cfg in arm_configs(preset, "cpu", sets + ["wandb.enabled=false"],
                                extra={"wandb": {"group": "g"}}):
        if arm.name in finished or arm.name in unfinished:
            fake_arm(run_dir, cfg, 4 if arm.name in finished else 2,
                     0 if arm.name in finished else 1)


def test_a_rerun_keeps_finished_arms_and_trains_the_others(tmp_path):
    """Into a grid's folder: a finished arm is kept (its result read back), an
    unfinished one is trained again (the trainer resumes or restarts its run),
    arms not yet run are added; unselected arms in the folder are kept as they are."""
    fake_grid(tmp_path, finished=["kv_shift-1L"], unfinished=["vanilla-2L"])
    configs = arm_configs("fig1a", "cpu", TINY + ["wandb.enabled=false"])
    # an arm the runner was stopped before starting: its arm.yaml alone
    (tmp_path / "arms" / "vanilla-4L").mkdir()
    (tmp_path / "arms" / "vanilla-4L" / "arm.yaml").write_text(dump_yaml(configs[3][1]))
    jobs = arm_jobs(configs, tmp_path)
    assert [(j.arm.name, j.earlier is not None) for j in jobs] == [
        ("kv_shift-1L", True), ("vanilla-1L", False), ("vanilla-2L", False),
        ("vanilla-4L", False)]
    kept = jobs[0].earlier
    assert (kept.exit_code, kept.wall_s, [r["step"] for r in kept.rows]) == (0, 7.0, [2, 4])
    jobs = arm_jobs(configs, tmp_path, selected=["vanilla-1L"])
    assert [(j.arm.name, j.earlier is not None) for j in jobs] == [
        ("kv_shift-1L", True), ("vanilla-1L", False), ("vanilla-2L", True), ("vanilla-4L", True)]
    assert jobs[2].earlier.exit_code == 1 and jobs[2].earlier.rows[-1]["step"] == 2
    assert jobs[3].earlier.exit_code is None and jobs[3].earlier.rows == []


def test_a_rerun_of_a_finished_grid_merges_every_arm_without_training(tmp_path, capsys):
    """A second --arms selection into a grid's folder: the results are those of
    every arm the folder holds (a first version replaced them with the selection's)."""
    fake_grid(tmp_path, finished=["kv_shift-1L", "vanilla-2L"])
    rc = main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(tmp_path),
               "--arms", "vanilla-2L", *TINY_SETS])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "[vanilla-2L] finished earlier" in out
    check_outputs(tmp_path, ["kv_shift-1L", "vanilla-2L"])
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["arms"] == ["kv_shift-1L", "vanilla-2L"] and spec["wandb_group"] == "g"
    assert not (tmp_path / "arms" / "vanilla-2L" / "train.log").exists()  # nothing trained


@pytest.mark.parametrize("grid, args, message", [
    ({"finished": ["vanilla-2L"], "sets": TINY + ["train.max_steps=6"]}, [],
     "arms/vanilla-2L/arm.yaml differs from this command's config of arm vanilla-2L "
     "(train.max_steps: 6 -> 4)"),
    ({"finished": ["vanilla-2L"], "preset": "fig1b"}, [],
     "holds an experiment of preset fig1b (scale cpu), not fig1a (cpu)"),
])
def test_an_incompatible_rerun_is_one_line(tmp_path, capsys, grid, args, message):
    fake_grid(tmp_path / "x", **grid)
    rc = main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(tmp_path / "x"),
               *TINY_SETS, *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_a_damaged_spec_is_refused(tmp_path):
    (tmp_path / "spec.json").write_text("{")
    with pytest.raises(ConfigError, match=r"spec.json: not JSON .* choose another --run-dir"):
        earlier_group(tmp_path, "fig1a", "cpu")


def test_a_folder_with_arms_of_another_preset_is_refused(tmp_path):
    fake_grid(tmp_path, finished=["kv_shift-2L"], preset="ngram",
              sets=["train.max_steps=4", "train.eval_interval=2"])
    (tmp_path / "spec.json").unlink()
    with pytest.raises(ConfigError, match=r"holds arm\(s\) kv_shift-2L, not arms of this preset"):
        arm_jobs(arm_configs("fig1a", "cpu", TINY), tmp_path)


def test_summary_json_of_an_arm_without_a_curve_is_strict_json(tmp_path, capsys):
    """An arm that failed before its first evaluation has no curve: its numbers
    are null in summary.json (NaN is not JSON: jq and JSON.parse refuse the file)."""
    fake_grid(tmp_path, finished=["kv_shift-1L"])
    cfg = arm_configs("fig1a", "cpu", TINY + ["wandb.enabled=false"],
                      extra={"wandb": {"group": "g"}})[3][1]
    (tmp_path / "arms" / "vanilla-4L").mkdir()
    (tmp_path / "arms" / "vanilla-4L" / "arm.yaml").write_text(dump_yaml(cfg))
    (tmp_path / "arms" / "vanilla-4L" / "result.json").write_text(
        json.dumps({"exit_code": 1, "wall_s": 3.0, "started": 100.0}))
    assert main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(tmp_path),
                 "--arms", "kv_shift-1L", *TINY_SETS]) == 1
    assert "arm(s) vanilla-4L failed" in capsys.readouterr().out

    def refuse(name):
        raise ValueError(f"{name} in summary.json")
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    failed = summary["arms"]["vanilla-4L"]
    assert (failed["final_accuracy"], failed["final_step"], failed["exit_code"]) == (None, None, 1)
    assert summary["arms"]["kv_shift-1L"]["final_accuracy"] == 1.0


def test_the_steps_each_arm_trains_are_printed_when_train_tokens_sets_them(tmp_path, capsys):
    """train.train_tokens (512 = 4 steps of 4 x 32 tokens) sets the run length,
    not train.max_steps (null): the opening line says 4 steps, not None."""
    sets = [x for x in TINY if not x.startswith("train.max_steps")] + [
        "train.max_steps=null", "train.train_tokens=512"]
    fake_grid(tmp_path, finished=["kv_shift-1L"], sets=sets)
    assert main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(tmp_path),
                 "--arms", "kv_shift-1L", "--no-wandb",
                 *[x for kv in sets for x in ("--set", kv)]]) == 0
    out = capsys.readouterr().out
    assert "1 arms (kv_shift-1L), 4 steps each" in out and "finished earlier" in out, out


def test_a_run_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    """A file in --run-dir's path, or a folder the system will not make (here
    /proc's): one line before any arm trains, not mkdir's traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for run_dir, message in (
            (blocker / "x", f"--run-dir {blocker}/x: {blocker} is a file, not a folder"),
            ("/proc/kvtrain-grid", "--run-dir /proc/kvtrain-grid cannot be made: "
                                   "No such file or directory")):
        assert main(["experiment", "induction", "--preset", "fig1b", "--no-wandb",
                     "--run-dir", str(run_dir)]) == 2
        assert capsys.readouterr().err == f"kvtrain: config error: {message}\n"


def test_an_arm_stopped_before_its_last_step_fails_the_experiment(tmp_path, capsys):
    """An arm that exits 0 short of its steps (train.exit_duration_minutes, a stop
    request) has a checkpoint, not a result: the command says so and exits 1."""
    run_dir = tmp_path / "fig1a"
    sets = [x for kv in [*TINY, "train.exit_duration_minutes=1e-6"] for x in ("--set", kv)]
    rc = main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(run_dir),
               "--arms", "vanilla-1L", "--threads", "1", "--no-wandb", *sets])
    out = capsys.readouterr().out
    assert rc == 1, out
    # the toy tasks save no checkpoint (checkpoint.save_on_exit: false)
    assert "[vanilla-1L] stopped short of step 4, with no checkpoint: it starts over in " in out
    assert "kvtrain: arm(s) vanilla-1L failed or did not finish; see " in out, out
