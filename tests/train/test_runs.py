"""End-to-end runs of ``kvtrain train`` as a user starts it (subprocesses).

Covered here: the loss falls on tokenized text; the run folder and metrics;
SIGKILL in the middle of a checkpoint save; SIGTERM/SIGUSR1 (one rank
signalled, all ranks stop at the same step, save, exit 0, resume at the next
step); wandb offline files and the resumed run's id; non-finite steps;
the time limit and the token budget; async checkpoints from an entry script
without a ``__main__`` guard.
"""

from __future__ import annotations

import json
import math
import signal
import textwrap
from pathlib import Path

import pytest
import yaml

from .conftest import (
    by_iteration, finish, latest, metrics, run, run_driver, start, tiny_config, wait_for,
    write_config,
)

TOKENS_PER_STEP = 8 * 32  # global batch x sequence length of tiny_config


def train_args(config: Path, run_dir: Path, *overrides: str) -> list[str]:
    args = ["train", str(config), "--run-dir", str(run_dir)]
    for o in overrides:
        args += ["--set", o]
    return args


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory, corpus, cache_dir):
    """Three short runs in one launch (the test driver forks a process per run):
    50 steps on text; non-finite steps; the time limit with a token budget."""
    root = tmp_path_factory.mktemp("short_runs")
    configs = {
        "loss": tiny_config(
            corpus, cache_dir,
            train={"max_steps": 50, "log_interval": 5, "eval_interval": 25, "eval_iters": 2,
                   "kv_shift_stats_interval": 25},
            checkpoint={"save_interval": 25, "keep_last": 1}),
        "nonfinite": tiny_config(
            corpus, cache_dir, train={"max_steps": 20, "max_consecutive_nonfinite": 3},
            checkpoint={"save_interval": None}),
        "timelimit": tiny_config(
            None, cache_dir, train={"max_steps": None, "train_tokens": 10 * TOKENS_PER_STEP - 5,
                                    "exit_duration_minutes": 0.0005},
            # longer than the run, and a floor the constant schedule never reads: warnings
            optimizer={"lr_warmup_steps": 12, "min_lr": 1e-4}),
    }
    jobs = [{"config": str(write_config(root / f"{name}.yaml", cfg)), "run_dir": str(root / name),
             "faults": {"nonfinite_steps": [3, 6, 7, 8]} if name == "nonfinite" else {},
             "expect": 3 if name == "nonfinite" else 0}
            for name, cfg in configs.items()]
    result = run_driver(jobs, root / "plan.json", nproc=1, timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root, result


def test_loss_falls_on_tokenized_text(short_runs, corpus):
    root, _ = short_runs
    run_dir = root / "loss"

    train = metrics(run_dir)
    assert [r["iteration"] for r in train] == list(range(5, 51, 5))
    first, last = train[0]["lm_loss"], train[-1]["lm_loss"]
    assert last < first - 0.5, (corpus.kind, [r["lm_loss"] for r in train])
    assert first < math.log(384) + 0.5  # starts near uniform over the vocabulary
    record = train[-1]
    for key in ("consumed_samples", "consumed_tokens", "lm_loss", "lr", "grad_norm",
                "step_time_s", "tokens_per_s", "tflops_per_device", "peak_memory_gib"):
        assert isinstance(record[key], (int, float)) and record[key] >= 0, key
    assert record["consumed_samples"] == 50 * 8
    assert record["consumed_tokens"] == 50 * TOKENS_PER_STEP
    assert record["mfu"] is None  # no peak FLOP/s known for a CPU

    valid = metrics(run_dir, "valid")
    assert [r["iteration"] for r in valid] == [25, 50]
    assert valid[-1]["val_loss"] < valid[0]["val_loss"]
    assert valid[-1]["val_ppl"] == pytest.approx(math.exp(valid[-1]["val_loss"]))
    shift = metrics(run_dir, "kv_shift")
    assert [r["iteration"] for r in shift] == [25, 50]
    assert shift[-1]["kv_shift/kv_heads"] == 2 * 2  # layers x KV heads
    assert sum(v for k, v in shift[-1].items() if "/quadrant/" in k) == 4
    assert "kv_shift/layer_02/beta2" in shift[-1]

    # run folder: the resolved config (loadable as is), checkpoints, metrics
    from kvtrain.config import load_config

    saved = load_config(run_dir / "config.yaml")
    assert saved.train.max_steps == 50 and saved.data.paths == [corpus.prefix]
    assert latest(run_dir) == "iter_0000050"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        ".kvtrain.lock", "iter_0000050", "latest"]  # keep_last: 1; the folder's lock


def test_sigkill_in_save_then_sigterm_then_resume(tmp_path, corpus, cache_dir):
    """A kill while a checkpoint is being written leaves ``latest`` on the previous
    complete one; the resumed run is exact, survives a SIGTERM (checkpoint at the
    next step boundary, exit 0) and resumes again at the following step. The run
    length comes from train.train_tokens (no max_steps)."""
    steps = 30
    config = write_config(tmp_path / "c.yaml", tiny_config(
        corpus, cache_dir, train={"max_steps": None, "train_tokens": steps * TOKENS_PER_STEP},
        checkpoint={"save_interval": 3, "keep_last": 2}))
    run_dir = tmp_path / "run"

    # 1. killed while saving iteration 6 (an injected fault: SIGKILL after the shards
    #    are written, before the checkpoint is marked complete and `latest` moves)
    first = run_driver([{"config": str(config), "run_dir": str(run_dir),
                         "faults": {"kill_in_save": 6}, "expect": -9}], tmp_path / "plan.json")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert latest(run_dir) == "iter_0000003"
    partial = run_dir / "checkpoints" / "iter_0000006.incomplete"
    assert partial.is_dir() and not (partial / "kvtrain_checkpoint.json").exists()
    assert not (run_dir / "checkpoints" / "iter_0000006").exists()
    before_kill = by_iteration(metrics(run_dir))
    assert sorted(before_kill) == list(range(1, 7))

    # 2. resumes from iteration 3; SIGTERM once it is past iteration 8
    log, status = tmp_path / "second.log", tmp_path / "status" / "second"
    proc = start(train_args(config, run_dir) + ["--status-file", str(status)], log=log)
    wait_for(lambda: max((r["iteration"] for r in metrics(run_dir)), default=0) >= 8
             and "resumed from" in log.read_text(), what="iteration 8 of the resumed run")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"resumed from {run_dir / 'checkpoints' / 'iter_0000003'} at iteration 3" in text
    second = by_iteration(metrics(run_dir))
    stopped_at = max(second)
    assert 8 <= stopped_at < steps
    assert latest(run_dir) == f"iter_{stopped_at:07d}"  # saved at the step boundary
    assert "stopped at iteration" in text and "stop signal" in text
    # what launch/slurm.sbatch reads to requeue the job (stopped) or not (finished)
    assert status.read_text() == f"stopped {stopped_at}/{steps}\n"
    for it in (4, 5, 6):  # exact across the kill
        assert second[it]["lm_loss"] == before_kill[it]["lm_loss"]
        assert second[it]["grad_norm"] == before_kill[it]["grad_norm"]

    # 3. resumes at the following step and runs to the token budget (saving only
    #    at the end this time)
    third = run(train_args(config, run_dir, "checkpoint.save_interval=null") +
                ["--status-file", str(status)])
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert status.read_text() == f"finished {steps}/{steps}\n"
    assert f"at iteration {stopped_at}" in third.stdout
    final = metrics(run_dir)
    assert [r["iteration"] for r in final] == list(range(1, steps + 1))
    assert final[-1]["consumed_tokens"] == steps * TOKENS_PER_STEP
    complete = sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*"))
    assert complete == [f"iter_{stopped_at:07d}", f"iter_{steps:07d}"]  # keep_last 2
    assert not list((run_dir / "checkpoints").glob(".trash-*"))
    assert not list((run_dir / "checkpoints").glob("*.incomplete"))


@pytest.mark.slow
def test_signal_to_one_rank_stops_all_and_wandb_resumes_same_run(tmp_path, corpus, cache_dir):
    """DP=2 under torchrun: SIGUSR1 to rank 1 only; both ranks stop after the same
    step, save and exit 0; the resumed run (one process) starts at the next step
    and logs to the same wandb run (its offline folders carry the run id)."""
    import psutil

    config = write_config(tmp_path / "c.yaml", tiny_config(
        corpus, cache_dir, train={"max_steps": 500, "kv_shift_stats_interval": 2},
        checkpoint={"save_interval": None}, wandb={"enabled": True, "mode": "offline",
                                                   "project": "kvtrain-tests"}))
    run_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    proc = start(train_args(config, run_dir), nproc=2, log=log)
    wait_for(lambda: len(metrics(run_dir)) >= 3, what="three steps")
    ranks = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and "kvtrain.cli" in " ".join(child.cmdline()):
            ranks[rank] = child
    assert set(ranks) == {"0", "1"}, ranks
    ranks["1"].send_signal(signal.SIGUSR1)
    assert finish(proc) == 0, log.read_text()[-4000:]
    stopped_at = metrics(run_dir)[-1]["iteration"]
    assert stopped_at < 500
    assert latest(run_dir) == f"iter_{stopped_at:07d}"
    marker = json.loads((run_dir / "checkpoints" / latest(run_dir) /
                         "kvtrain_checkpoint.json").read_text())
    assert marker["layout"]["data"] == 2

    # resumed by one process (DP=2 -> DP=1): the same wandb run continues
    resumed = run(train_args(config, run_dir, f"train.max_steps={stopped_at + 2}"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"at iteration {stopped_at}" in resumed.stdout
    assert [r["iteration"] for r in metrics(run_dir)][-2:] == [stopped_at + 1, stopped_at + 2]

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    # wandb names each start's offline folder after the run: one per start, one run id
    starts = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(starts) == 2 and all(p.name.endswith(f"-{run_id}") for p in starts), starts
    # what went to wandb is what metrics.jsonl holds (MetricsLogger writes both;
    # tests/train/test_units.py checks the wandb names of every record kind)
    shift = metrics(run_dir, "kv_shift")
    assert shift and "kv_shift/layer_01/alpha1" in shift[-1]


def test_nonfinite_steps_are_skipped_then_the_run_stops(short_runs):
    root, result = short_runs
    run_dir = root / "nonfinite"
    assert result.job_codes[str(run_dir)] == [3]  # the exit code of a non-finite stop
    assert "3 steps in a row had a non-finite loss or gradient norm" in result.stdout
    events = [r for r in metrics(run_dir, "event") if r.get("skipped")]
    assert [(r["iteration"], r["skipped"]) for r in events] == [
        (3, "nonfinite"), (6, "nonfinite"), (7, "nonfinite"), (8, "nonfinite")]
    assert [r["nonfinite_in_row"] for r in events] == [1, 1, 2, 3]
    train = by_iteration(metrics(run_dir))
    assert train[3]["lm_loss"] == "nan" and train[3]["skipped_steps"] == 1
    assert math.isfinite(train[4]["lm_loss"]) and math.isfinite(train[5]["lm_loss"])
    assert train[5]["skipped_steps"] == 1 and train[8]["skipped_steps"] == 4
    # saved at the stop, with only the 4 good updates applied (1, 2, 4, 5)
    assert latest(run_dir) == "iter_0000008"
    import torch

    common = torch.load(run_dir / "checkpoints" / "iter_0000008" / "common.pt",
                        weights_only=False)
    assert common["opt_param_scheduler"]["num_steps"] == 4
    assert common["kvtrain"]["state"]["skipped_steps"] == 4


def test_time_limit_stops_and_token_budget_sets_length(short_runs):
    root, result = short_runs
    assert result.job_codes[str(root / "timelimit")] == [0]
    assert "stopped at iteration 1/10 because of train.exit_duration_minutes" in result.stdout
    # said once, at the start of the one run whose warmup outlasts it
    assert result.stdout.count("kvtrain: warning: optimizer.lr_warmup_steps (12) is longer "
                               "than the run (10 steps): the LR never reaches optimizer.lr "
                               "(0.003); its last step trains at 0.0025") == 1, result.stdout
    assert result.stdout.count("kvtrain: warning: optimizer.min_lr (0.0001) not used: "
                               "optimizer.lr_schedule constant keeps optimizer.lr after the "
                               "warmup (cosine or wsd decay)") == 1, result.stdout
    assert latest(root / "timelimit") == "iter_0000001"


def test_a_token_budget_holds_when_the_batch_or_its_length_changes_on_resume(tmp_path, corpus,
                                                                             cache_dir):
    """train.train_tokens counts tokens; steps differ by global batch. Resuming with
    another train.global_batch_size is refused in one line naming the key, unless
    checkpoint.allow_config_changes names it: the run then ends when the consumed
    tokens reach the budget (the checkpoint's 4 steps of 8 samples, then 3 of 16),
    its cosine schedule reaching min_lr there, not at the 5 steps of 16 of a fresh run.
    The same checkpoint resumed with an allowed train.seq_length of 16 (in another
    folder) counts the tokens it consumed at 32: 12 steps of 8 x 16 are left, not
    the 16 that its samples counted at the new length would leave."""
    budget = 10 * TOKENS_PER_STEP
    jobs = []
    for name, gbs, extra in (("first", 8, {"faults": {"stop_after": 4}}),
                             ("refused", 16, {"expect": 2}), ("allowed", 16, {}),
                             ("shorter", 8, {})):
        cfg = tiny_config(corpus, cache_dir,
                          train={"max_steps": None, "train_tokens": budget,
                                 "global_batch_size": gbs},
                          optimizer={"lr_schedule": "cosine", "min_lr": 1e-4},
                          checkpoint={"save_interval": None, "allow_config_changes":
                                      ["train.global_batch_size"] if name == "allowed" else []})
        if name == "shorter":
            cfg["train"]["seq_length"] = 16
            cfg["checkpoint"].update(resume=str(tmp_path / "run" / "checkpoints" / "iter_0000004"),
                                     allow_config_changes=["train.seq_length"])
        jobs.append({"config": str(write_config(tmp_path / f"{name}.yaml", cfg)),
                     "run_dir": str(tmp_path / ("run" if name != "shorter" else name)), **extra})
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "config error" in line]
    assert len(errors) == 1 and "train.global_batch_size: 8 -> 16" in errors[0] and \
        "checkpoint.allow_config_changes: [train.global_batch_size]" in errors[0], errors
    train = by_iteration(metrics(tmp_path / "run"))
    assert sorted(train) == [1, 2, 3, 4, 5, 6, 7]  # nothing lost to the refused start
    assert train[7]["consumed_tokens"] == budget
    assert train[6]["lr"] > 1e-4 and train[7]["lr"] == pytest.approx(1e-4)
    assert "after the checkpoint's 1024 tokens: 12 steps of 8 x 16 left, the run and its LR " \
        "schedule end at step 16 (not 20)" in result.stdout
    shorter = by_iteration(metrics(tmp_path / "shorter"))
    assert sorted(shorter) == list(range(5, 17)) and shorter[16]["consumed_tokens"] == budget
    assert shorter[15]["lr"] > 1e-4 and shorter[16]["lr"] == pytest.approx(1e-4)


def test_async_save_from_an_unguarded_entry_script(tmp_path, cache_dir):
    """An entry script without ``if __name__ == "__main__":`` (the spawn
    trap: megatron's writer starts a spawn-context Manager that re-imports the
    main module) saves asynchronously and finishes."""
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 4},
        checkpoint={"save_interval": 2, "async_save": True}))
    run_dir = tmp_path / "run"
    script = tmp_path / "train_no_guard.py"
    script.write_text(textwrap.dedent(f"""\
        import sys
        from kvtrain.cli import main
        code = main(["train", {str(config)!r}, "--run-dir", {str(run_dir)!r}])
        print("exit code", code)
        sys.exit(code)
        """))
    result = run([], script=script, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert latest(run_dir) == "iter_0000004"
    for it in (2, 4):
        assert (run_dir / "checkpoints" / f"iter_{it:07d}" / "kvtrain_checkpoint.json").exists()


@pytest.mark.slow
def test_demo_command(tmp_path):
    """``kvtrain demo`` (what ``make demo`` runs): data, tokenizer, shards, the two
    arms side by side, their comparison; a rerun finishes (continues) the arms."""
    demo = tmp_path / "demo"
    args = ["demo", "--run-dir", str(demo), "--steps", "3", "--set", "train.log_interval=1",
            "--set", "train.eval_interval=3", "--set", "wandb.enabled=false"]
    result = run(args, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "kvtrain demo: done in" in result.stdout
    for arm in ("vanilla", "kv_shift"):
        assert [r["iteration"] for r in metrics(demo / arm)] == [1, 2, 3]
        assert latest(demo / arm) == "iter_0000003"
        assert yaml.safe_load((demo / arm / "config.yaml").read_text())["model"]["attention"] == arm
    assert f"comparison plot: {demo / 'compare' / 'loss.png'}" in result.stdout
    assert (demo / "compare" / "report.md").is_file()
    again = run(args, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("already trained to iteration 3") == 2
    assert "kvtrain compare: A = vanilla" in again.stdout


@pytest.mark.gpu
def test_bf16_and_async_save_on_gpu(tmp_path, cache_dir):
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 20, "precision": "bf16"},
        checkpoint={"save_interval": 10, "async_save": True}))
    run_dir = tmp_path / "run"
    result = run(train_args(config, run_dir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train = metrics(run_dir)
    assert train[-1]["lm_loss"] < train[0]["lm_loss"]
    assert train[-1]["memory_kind"] == "cuda_allocated"
    assert latest(run_dir) == "iter_0000020"
    resumed = run(train_args(config, run_dir, "train.max_steps=22"))
    assert resumed.returncode == 0 and "at iteration 20" in resumed.stdout


@pytest.mark.gpu
def test_fp16_trains_with_a_dynamic_loss_scale_that_resumes(tmp_path, cache_dir):
    """train.precision fp16 (GPU only; refused on a CPU): megatron's dynamic loss
    scale is logged, the loss falls, and a resume continues the scaler where the
    checkpoint left it (not from its initial 2**32), close to the uninterrupted run.
    On an H200 the scale backed off through the first 10 steps, every update skipped,
    and the save of step 10 died in megatron's distributed optimizer (no AdamW state
    yet: ``fresh_adam_state``); 30 steps leave updates after the scale has settled."""
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 30, "precision": "fp16"},
        checkpoint={"save_interval": 10}))
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for args in (train_args(config, whole), train_args(config, cut, "train.max_steps=10"),
                 train_args(config, cut)):
        result = run(args)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    a, b = by_iteration(metrics(whole)), by_iteration(metrics(cut))
    assert sorted(a) == sorted(b) == list(range(1, 31))
    assert all(r["loss_scale"] > 0 for r in a.values())
    assert a[10]["loss_scale"] < 2.0**32  # backed off from megatron's initial scale
    assert a[30]["lm_loss"] < a[1]["lm_loss"]
    for it in range(11, 31):
        assert b[it]["loss_scale"] == a[it]["loss_scale"], it
        assert b[it]["lm_loss"] == pytest.approx(a[it]["lm_loss"], rel=1e-2), it


@pytest.mark.parametrize("mistake", ["bad-set", "run-dir-is-a-file", "no-workers", "arm-key",
                                     "checkpoint-dir"])
def test_demo_mistakes_are_one_line_before_anything_is_built_or_cleared(tmp_path, capsys,
                                                                        mistake):
    """A bad --set is found before the data is built and before --fresh clears
    the arms (it was found after both: their checkpoints were already gone)."""
    from kvtrain.cli import main

    demo = tmp_path / "demo"
    kept = demo / "vanilla" / "checkpoints" / "iter_0000003" / "kvtrain_checkpoint.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    if mistake == "bad-set":
        args, message = ["--run-dir", str(demo), "--set", "train.max_step=3"], (
            "kvtrain: config error: --set: unknown key 'train.max_step' "
            "(did you mean 'train.max_steps'?)")
    elif mistake == "arm-key":  # the demo set its own after it: the user's was lost, unsaid
        args = ["--run-dir", str(demo), "--set", "model.attention=vanilla"]
        message = ("kvtrain: config error: --set model.attention: the demo sets it for each "
                   "arm (vanilla, kv_shift); train one config with kvtrain train")
    elif mistake == "checkpoint-dir":  # --fresh left it, and both arms shared an absolute one
        args = ["--run-dir", str(demo), "--set", "checkpoint.dir=ck"]
        message = ("kvtrain: config error: --set checkpoint.dir: the demo sets it for each "
                   "arm (vanilla, kv_shift); train one config with kvtrain train")
    elif mistake == "no-workers":  # --workers 0 (or -1) ran the demo with one
        args = ["--run-dir", str(demo), "--workers", "0"]
        message = "kvtrain: config error: --workers and --nproc must be at least 1, got 0 and 1"
    else:
        (tmp_path / "notes.txt").write_text("x")
        args = ["--run-dir", str(tmp_path / "notes.txt")]
        message = f"kvtrain: config error: --run-dir {tmp_path / 'notes.txt'} is a file, not a folder"
    assert main(["demo", "--fresh", *args]) == 2
    assert capsys.readouterr().err.strip() == message
    assert kept.read_text() == "{}" and sorted(p.name for p in demo.iterdir()) == ["vanilla"]


def test_a_failing_demo_data_step_is_its_own_line_and_one_more(tmp_path, capfd):
    """A data tool that fails under kvtrain demo (here: an empty corpus.jsonl left in
    the data folder, so train-tokenizer has no text) was the tool's line and then a
    CalledProcessError traceback; now the tool's line and one line naming the step."""
    from kvtrain.cli import main

    data = tmp_path / "demo" / "data"
    data.mkdir(parents=True)
    (data / "corpus.jsonl").write_text("")
    assert main(["demo", "--run-dir", str(tmp_path / "demo"), "--steps", "1"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [
        "kvtrain data train-tokenizer: error: no text to train on: every input document was "
        "skipped or empty",
        f"kvtrain: data error: kvtrain data train-tokenizer failed (exit 1, its error is "
        f"above): fix or remove what it reads in {data} and rerun"], err


DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


@pytest.mark.parametrize("folder", ["demo,v2", "demo[1]", "demo {a}", "demo #2", "it's"])
def test_demo_data_overrides_survive_yaml_characters_in_the_run_dir(tmp_path, monkeypatch,
                                                                    folder):
    """The shard prefixes and the tokenizer are pasted into --set values: a comma
    split one prefix into two, a bracket or ' #' made a YAML error or a comment."""
    from kvtrain.commands import demo
    from kvtrain.config import load_config

    data = tmp_path / folder / "data"
    cfg = load_config(DEMO_CONFIG, demo.prepare_data(data, synthetic=True))
    assert cfg.data.paths == [str(data / "synthetic" / "corpus")]
    # the data tools' path, without building a tokenizer: its files stand in
    (data / "corpus.jsonl").write_text("")
    (data / "tokenizer.model").write_text("")
    (data / "shards").mkdir()
    (data / "shards" / "demo.idx").write_text("")
    monkeypatch.setattr(demo, "_data_tools_available", lambda: True)
    cfg = load_config(DEMO_CONFIG, demo.prepare_data(data))
    assert cfg.data.paths == [str(data / "shards" / "demo")]
    assert cfg.data.tokenizer == str(data / "tokenizer.model")


def test_demo_data_a_killed_build_left_is_built_again(tmp_path, monkeypatch):
    """A preprocessing killed between its .bin and its .idx left the shard's .bin: the
    demo builds the shards again, where the data tools refuse outputs that exist."""
    import shutil

    from data_tools.indexed import IndexedReader
    from kvtrain.commands import demo
    from tests.data_tools.dt_helpers import DOCS, tokenizer, write_jsonl

    data = tmp_path / "data"
    (data / "shards").mkdir(parents=True)
    write_jsonl(data / "corpus.jsonl", DOCS)
    shutil.copy(tokenizer(), data / "tokenizer.model")
    (data / "shards" / "demo_text_document.bin").write_bytes(b"cut short")
    monkeypatch.setattr(demo, "_data_tools_available", lambda: True)
    overrides = demo.prepare_data(data)
    prefix = str(data / "shards" / "demo_text_document")
    assert overrides[0] == f"data.paths={json.dumps([prefix])}"
    assert IndexedReader(prefix).num_documents == len(DOCS)


def test_demo_rerun_of_a_token_budget_knows_when_an_arm_is_done(tmp_path):
    """`kvtrain demo --set train.max_steps=null --set train.train_tokens=N` is valid
    (the trainer derives the steps): the rerun compared the checkpoint's iteration
    with None (TypeError); it compares with the run's total steps."""
    from kvtrain.commands.demo import finished_at

    folder = tmp_path / "kv_shift" / "checkpoints" / "iter_0000010"
    folder.mkdir(parents=True)
    (folder / "kvtrain_checkpoint.json").write_text("{}")
    (folder.parent / "latest").write_text(folder.name)
    budget = ["train.max_steps=null", "train.train_tokens=20480"]  # 10 steps of 16 x 128
    assert finished_at(DEMO_CONFIG, tmp_path, "kv_shift", budget, 1) == 10
    longer = ["train.max_steps=null", "train.train_tokens=22528"]  # 11 steps
    assert finished_at(DEMO_CONFIG, tmp_path, "kv_shift", longer, 1) is None
    both = ["train.max_steps=10", "train.train_tokens=1e9"]
    assert finished_at(DEMO_CONFIG, tmp_path, "kv_shift", both, 1) == 10
