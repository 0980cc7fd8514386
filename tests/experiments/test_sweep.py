"""``kvtrain sweep``: a config over a grid of settings (the paper's Appendix H
tables), each cell a ``kvtrain train`` run; its grid, cells, refusals, tables, and a
real two-cell sweep continued and extended."""

from __future__ import annotations

import json
import shlex

import pytest

from kvtrain.cli import main
from kvtrain.config import ConfigError, load_config, to_dict
from kvtrain.experiments.sweep import Axis, cell_name, parse_grid, sweep_cells, tables
from tests.launch.conftest import REPO

TINY = str(REPO / "configs" / "tiny.yaml")


def test_the_grid_and_the_cells_names():
    axes = parse_grid(["optimizer.lr=1e-4,2e-4", "data.paths=[a,b],[c]"], ["train.seed=3"])
    assert axes == [Axis("optimizer.lr", ("1e-4", "2e-4")), Axis("data.paths", ("[a,b]", "[c]"))]
    assert cell_name(axes, ("1e-4", "[a,b]")) == "lr=1e-4,paths=a_b"
    same = [Axis("model.kv_shift.window", ("1",)), Axis("train.window", ("2",))]
    assert cell_name(same, ("1", "2")) == "model.kv_shift.window=1,train.window=2"


@pytest.mark.parametrize("grids, sets, error", [
    ([], [], "kvtrain sweep needs at least one --grid KEY=V1,V2,..."),
    (["optimizer.lr"], [], "--grid 'optimizer.lr': expected KEY=V1,V2,..."),
    (["optimizer.lr=1e-4,"], [], "--grid 'optimizer.lr=1e-4,': expected KEY=V1,V2,..."),
    (["optimizer.lr=1e-4", "optimizer.lr=2e-4"], [], "--grid optimizer.lr: given twice"),
    (["optimizer.lr=1e-4"], ["optimizer.lr=3e-4"], "--grid optimizer.lr: also in --set"),
    (["optimizer.lr=1e-4,1e-4"], [], "--grid optimizer.lr: a value is listed twice"),
    # what each cell's command sets after them (its name, its run folder): lost, unsaid
    (["optimizer.lr=1e-4,2e-4"], ["run_dir=/tmp/elsewhere"],
     "--set run_dir: the sweep sets it for each cell (its folder: --run-dir DIR/arms/CELL/run; "
     "its name: the config's and the cell's)"),
    (["name=a,b"], [], "--grid name: the sweep sets it for each cell"),
])
def test_a_grid_that_cannot_hold_is_one_line(grids, sets, error):
    with pytest.raises(ConfigError) as e:
        parse_grid(grids, sets)
    assert str(e.value).startswith(error), str(e.value)


def test_every_combination_is_a_validated_cell_the_first_key_slowest():
    axes = parse_grid(["optimizer.lr=1e-3,3e-3", "train.seq_length=32,64"], [])
    cells = sweep_cells(TINY, ["train.max_steps=4"], axes)
    assert [c.name for c in cells] == ["lr=1e-3,seq_length=32", "lr=1e-3,seq_length=64",
                                       "lr=3e-3,seq_length=32", "lr=3e-3,seq_length=64"]
    for cell in cells:
        assert (cell.cfg.optimizer.lr, cell.cfg.train.seq_length) == \
            (cell.settings["optimizer.lr"], cell.settings["train.seq_length"])
        assert cell.cfg.train.max_steps == 4 and cell.cfg.name == f"tiny-{cell.name}"
    base = to_dict(load_config(TINY, ["train.max_steps=4"]))
    other = to_dict(cells[1].cfg)  # lr 1e-3, length 64: both unlike the file (3e-3, 32)
    differ = {f"{s}.{k}" for s in base if isinstance(base[s], dict)
              for k in base[s] if base[s][k] != other[s][k]}
    assert differ == {"optimizer.lr", "train.seq_length"}  # the grid's keys only


@pytest.mark.parametrize("grids, sets, error", [
    (["optimizer.lr=1e-3,fast"], [], "cell lr=fast: --grid: optimizer.lr: expected float"),
    (["train.seq_lenth=32"], [], "cell seq_lenth=32: --grid: unknown key 'train.seq_lenth' "
                                 "(did you mean 'train.seq_length'?)"),
    (["optimizer.lr=1e-3"], ["train.max_step=3"], "--set: unknown key 'train.max_step'"),
    (["optimizer.lr=1e-3,3e-3"], ["checkpoint.dir=/tmp/one"], "checkpoint.dir /tmp/one is one folder "
                                                         "for every cell of the sweep"),
    (["optimizer.lr=1e-3"], ["train.eval_interval=null"], "train.eval_interval null: the "
                                                          "sweep's table"),
    # a grid over absolute folders: two cells of one folder (the other key's cells)
    (["checkpoint.dir=/tmp/a,/tmp/b", "optimizer.lr=1e-3,3e-3"], [],
     "checkpoint.dir /tmp/a is one folder for cells dir=tmp_a,lr=1e-3 and dir=tmp_a,lr=3e-3"),
    (["train.eval_interval=4,null"], [], "cell eval_interval=null: train.eval_interval null: "
                                         "the sweep's table"),
])
def test_cells_that_cannot_hold_are_one_line(grids, sets, error):
    with pytest.raises(ConfigError) as e:
        sweep_cells(TINY, sets, parse_grid(grids, sets))
    assert str(e.value).startswith(error), str(e.value)


def test_a_grid_of_absolute_checkpoint_folders_gives_each_cell_its_own():
    """``--grid checkpoint.dir=/x,/y`` was refused as one folder for every cell
    (only the first cell's config was looked at): each cell has its own."""
    cells = sweep_cells(TINY, [], parse_grid(["checkpoint.dir=/tmp/x,/tmp/y"], []))
    assert [c.cfg.checkpoint.dir for c in cells] == ["/tmp/x", "/tmp/y"]


def test_the_tables_follow_the_last_two_keys_for_each_setting_of_the_others():
    axes = [Axis("model.attention", ("vanilla", "kv_shift")), Axis("optimizer.lr", ("1", "2")),
            Axis("train.seq_length", ("8", "16"))]
    losses = {("vanilla", "1", "8"): 3.0, ("vanilla", "1", "16"): 2.5,
              ("vanilla", "2", "8"): None, ("vanilla", "2", "16"): 2.75,
              ("kv_shift", "1", "8"): 2.0, ("kv_shift", "1", "16"): 2.25,
              ("kv_shift", "2", "8"): 1.5, ("kv_shift", "2", "16"): float("nan")}
    entries = [{"texts": list(t), "val_loss": v} for t, v in losses.items()]
    text = "\n".join(tables(axes, entries))
    assert "**model.attention = vanilla**" in text and "**model.attention = kv_shift**" in text
    assert "| optimizer.lr \\ train.seq_length | 8 | 16 |" in text
    vanilla, shifted = text.split("**model.attention = kv_shift**")
    assert "| 1 | 3.0000 | **2.5000** |" in vanilla and "| 2 | - | 2.7500 |" in vanilla
    assert "| 1 | 2.0000 | 2.2500 |" in shifted and "| 2 | **1.5000** | - |" in shifted
    one = tables([Axis("optimizer.lr", ("1", "2"))], [{"texts": ["1"], "val_loss": 2.0},
                                                      {"texts": ["2"], "val_loss": 1.0}])
    assert one[0] == "| optimizer.lr \\  | val loss |" and one[-1] == "| 2 | **1.0000** |"
    stopped = tables([Axis("optimizer.lr", ("1",))], [{"texts": ["1"], "val_loss": 2.0,
                                                       "finished": False, "step": 7}])
    assert stopped[-1] == "| 1 | **2.0000 (step 7, unfinished)** |"


def test_the_runner_reads_the_runs_own_validation_of_text_data(tmp_path):
    from kvtrain.experiments.results import curve_from_metrics

    records = [{"kind": "train", "iteration": 2, "lm_loss": 4.0, "lr": 1e-3},
               {"kind": "valid", "iteration": 2, "val_loss": 3.0},
               {"kind": "valid", "set": "code", "iteration": 2, "val_loss": 9.0}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (row,) = curve_from_metrics(tmp_path / "m.jsonl", "cell", "gpt")
    assert (row["loss"], row["train_loss"], row["step"]) == (3.0, 4.0, 2)
    assert row["accuracy"] != row["accuracy"]  # NaN: text data has no accuracy


@pytest.mark.slow
def test_a_sweep_trains_its_cells_continues_and_extends(tmp_path, capsys):
    run_dir = tmp_path / "sweep"
    common = [TINY, "--set", "train.max_steps=3", "--no-wandb", "--run-dir", str(run_dir),
              "--workers", "2", "--threads", "1"]
    assert main(["sweep", *common, "--grid", "optimizer.lr=1e-3,3e-3"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((run_dir / "sweep.json").read_text())
    for cell in summary["cells"]:
        metrics = run_dir / "arms" / cell["cell"] / "run" / "metrics.jsonl"
        valid = [json.loads(x) for x in metrics.read_text().splitlines()
                 if json.loads(x)["kind"] == "valid"]
        assert cell["val_loss"] == valid[-1]["val_loss"] and cell["step"] == 3
        assert cell["finished"] and f"| {cell['texts'][0]} | " in out
    assert (run_dir / "sweep.md").read_text().startswith("# kvtrain sweep")
    # again: both cells finished, kept; a grid extended trains only the new cell
    assert main(["sweep", *common, "--grid", "optimizer.lr=1e-3,3e-3,1e-2"]) == 0
    out = capsys.readouterr().out
    assert out.count("finished earlier: kept") == 2 and "[lr=1e-2] done" in out
    assert len(json.loads((run_dir / "sweep.json").read_text())["cells"]) == 3
    # another --set for the same cells: refused, nothing trained; so is a grid without a
    # cell the folder holds (its table would mix in a cell of another sweep)
    assert main(["sweep", *common, "--set", "train.seed=7",
                 "--grid", "optimizer.lr=1e-3,3e-3,1e-2"]) == 2
    assert "differs from this command's config of arm lr=1e-3" in capsys.readouterr().err
    assert main(["sweep", *common, "--grid", "optimizer.lr=1e-3,3e-3"]) == 2
    assert "holds arm(s) lr=1e-2, not arms of this preset or grid" in capsys.readouterr().err


def test_a_dry_run_prints_each_cells_command_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "sweep"
    assert main(["sweep", TINY, "--grid", "optimizer.lr=1e-3,3e-3", "--set",
                 "train.max_steps=3", "--run-dir", str(run_dir), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"kvtrain sweep: 2 cells (2) -> {run_dir}" and not run_dir.exists()
    # each line is a kvtrain train command giving the cell's config
    argv = shlex.split(lines[2])
    assert argv[:3] == ["kvtrain", "train", TINY]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = load_config(TINY, sets)
    assert (cfg.optimizer.lr, cfg.train.max_steps, cfg.name) == (3e-3, 3, "tiny-lr=3e-3")
    assert argv[-1] == str(run_dir / "arms" / "lr=3e-3" / "run")
    # a --run-dir the sweep itself refuses: its commands would all fail (a probe's)
    (tmp_path / "c.jsonl").write_text("x")
    assert main(["sweep", TINY, "--grid", "optimizer.lr=1e-3,3e-3", "--run-dir",
                 str(tmp_path / "c.jsonl"), "--dry-run"]) == 2
    assert capsys.readouterr().err == (f"kvtrain: config error: --run-dir {tmp_path}/c.jsonl "
                                       "is a file, not a folder\n")


@pytest.mark.slow
def test_cells_trained_from_the_dry_runs_commands_are_tabulated_not_retrained(tmp_path, capsys):
    """A cluster's way: each --dry-run line run as its own job; the sweep's command
    afterwards finds each cell's run finished (the trainer has nothing to do) and
    writes the table from their records."""
    from tests.train.conftest import run

    run_dir = tmp_path / "sweep"
    args = [TINY, "--grid", "optimizer.lr=1e-3,3e-3", "--set", "train.max_steps=3", "--set",
            "wandb.enabled=false", "--run-dir", str(run_dir)]
    assert main(["sweep", *args, "--dry-run"]) == 0
    commands = capsys.readouterr().out.strip().splitlines()[1:]
    for line in commands:
        result = run(shlex.split(line)[1:])  # `kvtrain` itself: python -m kvtrain.cli
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert main(["sweep", *args]) == 0
    capsys.readouterr()
    for cell in json.loads((run_dir / "sweep.json").read_text())["cells"]:
        log = (run_dir / "arms" / cell["cell"] / "train.log").read_text()
        assert "nothing to do: iteration 3 >= 3 steps" in log and cell["step"] == 3
        metrics = run_dir / "arms" / cell["cell"] / "run" / "metrics.jsonl"
        valid = [r for r in map(json.loads, metrics.read_text().splitlines())
                 if r["kind"] == "valid"]
        assert cell["val_loss"] == valid[-1]["val_loss"]


def test_a_dry_run_job_trained_with_other_settings_is_refused_not_tabulated(tmp_path, capsys):
    """A --dry-run job leaves the cell's run but no arm.yaml. The sweep's command given
    other --set values found that run finished (the trainer resumed it at iteration
    max_steps with nothing to do, only noting the change) and wrote its loss under the
    command's settings: a table of lr=3e-3 from runs trained at lr=1e-3. Refused in one
    line, before any trainer starts; the run's record is left as it was."""
    from kvtrain.config import dump_yaml

    run_dir = tmp_path / "sweep"
    trained = load_config(TINY, ["optimizer.lr=1e-3", "model.attention=vanilla",
                                 "name=tiny-attention=vanilla"])
    cell_run = run_dir / "arms" / "attention=vanilla" / "run"
    cell_run.mkdir(parents=True)
    (cell_run / "config.yaml").write_text(dump_yaml(trained))
    assert main(["sweep", TINY, "--grid", "model.attention=vanilla", "--set",
                 "optimizer.lr=3e-3", "--no-wandb", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvtrain: config error: {cell_run / 'config.yaml'} (the cell's run, "
                          "trained without arm.yaml: a --dry-run job) differs from this "
                          "command's config of cell attention=vanilla (optimizer.lr: 0.001 -> "
                          "0.003"), err
    assert not (cell_run.parent / "arm.yaml").exists()
    assert (cell_run / "config.yaml").read_text() == dump_yaml(trained)


@pytest.mark.parametrize("record", ["arm.yaml", "run/config.yaml"])
def test_a_dry_run_over_cells_of_other_settings_is_refused_as_the_sweep_is(tmp_path, capsys,
                                                                           record):
    """--dry-run over a folder whose cell was trained with other --set values (by the
    sweep: arm.yaml; by a --dry-run job: the run's config.yaml) printed the commands:
    run as jobs, they resumed that cell's run under the new settings (the trainer
    takes another optimizer.lr on a resume), and only the sweep's command afterwards
    refused the folder. Refused now as the sweep's own command refuses it."""
    from kvtrain.config import dump_yaml

    run_dir = tmp_path / "sweep"
    trained = load_config(TINY, ["optimizer.lr=1e-3", "model.attention=vanilla",
                                 "name=tiny-attention=vanilla"])
    path = run_dir / "arms" / "attention=vanilla" / record
    path.parent.mkdir(parents=True)
    path.write_text(dump_yaml(trained))
    args = ["sweep", TINY, "--grid", "model.attention=vanilla", "--run-dir", str(run_dir),
            "--dry-run", "--set"]
    assert main([*args, "optimizer.lr=3e-3"]) == 2
    out, err = capsys.readouterr()
    assert f"kvtrain: config error: {path} " in err and "(optimizer.lr: 0.001 -> 0.003" in err
    assert "kvtrain train" not in out
    assert main([*args, "optimizer.lr=1e-3"]) == 0  # the settings it was trained with
    assert "kvtrain train" in capsys.readouterr().out


def test_a_cell_stopped_before_its_last_step_is_named_and_the_sweep_fails(tmp_path, capsys):
    """A cell that exits 0 short of its steps (train.exit_duration_minutes, a stop
    request) has a checkpoint, not a result: the sweep says so and exits 1."""
    run_dir = tmp_path / "sweep"
    assert main(["sweep", TINY, "--grid", "train.seed=1", "--set", "train.max_steps=20",
                 "--set", "train.exit_duration_minutes=1e-6", "--no-wandb", "--run-dir",
                 str(run_dir), "--threads", "1"]) == 1
    out = capsys.readouterr().out
    assert "[seed=1] stopped short of step 20; it continues from its checkpoint of step 1 in " \
        in out, out
    assert "kvtrain: cell(s) seed=1 failed or did not finish; see " in out, out
    assert not json.loads((run_dir / "sweep.json").read_text())["cells"][0]["finished"]


@pytest.mark.parametrize("option", [["--workers", "0"], ["--nproc", "0"], ["--threads", "-1"]])
def test_runner_options_out_of_range_are_one_line(tmp_path, capsys, option):
    run_dir = tmp_path / "sweep"
    assert main(["sweep", TINY, "--grid", "train.seed=1,2", "--run-dir", str(run_dir),
                 *option]) == 2
    assert capsys.readouterr().err.strip() == \
        "kvtrain: config error: --workers and --nproc must be >= 1, --threads >= 0"
    assert not run_dir.exists()


def test_a_shard_no_cell_can_read_is_one_line_before_any_cell_trains(tmp_path, capsys,
                                                                     monkeypatch):
    """configs/demo.yaml run from another folder: its relative data.paths name no
    shard there. Each cell found it only once started (seconds each, a line each)."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "sweep"
    assert main(["sweep", str(REPO / "configs" / "demo.yaml"), "--grid", "train.seed=1,2",
                 "--run-dir", str(run_dir), "--no-wandb"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kvtrain: config error: cell seed=1: data.paths: shard "
                   "runs/demo/data/shards/demo_text_document.idx does not exist"), err
    assert not run_dir.exists()
    # a dry run's commands may run where the shards are mounted: printed, not refused
    assert main(["sweep", str(REPO / "configs" / "demo.yaml"), "--grid", "train.seed=1,2",
                 "--run-dir", str(run_dir), "--dry-run"]) == 0
