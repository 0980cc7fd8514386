"""``kvtrain eval``'s pieces that need no evaluation: the record's file name
(shots, long task lists), the one line on the run's wandb run (disabled, never
opened, failing, its folder not makeable), and the document prefix token read
from a kvtrain export's files."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from kvtrain.config import load_config
from kvtrain.evaluate.report import log_to_wandb, record_name

TASKS = {"kvt_mc": {"acc": 0.5}}


def test_the_record_name_keeps_shots_and_long_task_lists_apart():
    """``--num-fewshot 5`` names its shots; a task list too long for a file name
    is cut, and two lists cut alike (mmlu subsets differing at the end) are two
    files: the second evaluation replaced the first one's results."""
    assert record_name(["lambada"], 100, 5) == "lambada-iter_0000100-5shot.json"
    assert record_name(["lambada"], 100, 0) == "lambada-iter_0000100-0shot.json"
    subset = [f"mmlu_subject_{i:02d}" for i in range(10)]
    other = subset[:-1] + ["mmlu_other_zz"]
    names = {record_name(tasks, 100, 5) for tasks in (subset, other)}
    assert len(names) == 2, names
    for name in names:
        assert name.startswith("+".join(subset)[:100] + "+10tasks-")
        assert name.endswith("-iter_0000100-5shot.json") and len(name) < 160
    assert record_name(subset, 100, 5) == record_name(list(subset), 100, 5)  # stable


def _run(tmp_path, *sets: str, run_id: bool = True):
    cfg = load_config(None, ["wandb.mode=offline", *sets])
    if run_id:
        (tmp_path / "wandb_run_id").write_text("evaltst1\n")  # as the trainer left it
    return cfg


def test_a_run_without_wandb_is_said_and_not_logged(tmp_path):
    """The run's config switches wandb off: kvtrain eval says so, opens nothing."""
    cfg = _run(tmp_path, "wandb.enabled=false")
    assert log_to_wandb(cfg, tmp_path, 3, TASKS) == (
        "wandb: disabled in the run's config, not logged")


def test_a_run_that_never_opened_a_wandb_run_is_said_and_not_logged(tmp_path):
    """The run's config has wandb, but its folder holds no wandb_run_id: kvtrain
    eval does not open a wandb run of its own."""
    cfg = _run(tmp_path, run_id=False)
    assert log_to_wandb(cfg, tmp_path, 3, TASKS) == (
        f"wandb: {tmp_path} has no wandb_run_id (the run never opened one), not logged")
    assert not (tmp_path / "wandb_run_id").exists()


def test_a_wandb_that_fails_to_start_is_a_warning_and_a_line(tmp_path, monkeypatch, capsys):
    """wandb.init failing (no service, a timeout): its warning, then the line that
    the run was not logged to; the results are kept (written before)."""
    def failing_init(**kwargs):
        raise TimeoutError("wandb service did not start")

    monkeypatch.setitem(sys.modules, "wandb",
                        SimpleNamespace(init=failing_init, Settings=lambda **k: None))
    note = log_to_wandb(_run(tmp_path), tmp_path, 3, TASKS)
    assert note == "wandb: run evaltst1 not logged to (see the warning above)"
    assert "kvtrain: warning: wandb did not start" in capsys.readouterr().out


def test_a_wandb_folder_that_cannot_be_made_is_a_line_not_a_traceback(tmp_path, monkeypatch):
    """The run's wandb.dir cannot be made here (a run folder copied from a cluster
    whose wandb.dir was elsewhere; here: under a file). kvtrain eval had written its
    results, then stopped with a NotADirectoryError traceback."""
    def init(**kwargs):
        raise AssertionError("wandb started")

    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=init, Settings=lambda **k: None))
    (tmp_path / "blocker").write_text("x")
    cfg = _run(tmp_path, "wandb.dir=blocker/wandb")
    assert log_to_wandb(cfg, tmp_path, 3, TASKS) == (
        f"wandb: cannot make the run's wandb folder {tmp_path}/blocker/wandb (Not a directory), "
        "not logged")


def test_the_prefix_token_of_an_export_whose_files_are_damaged_or_list_several(tmp_path):
    """A kvtrain export's end-of-document id: generation_config.json's, else (that
    file unreadable or not JSON) config.json's; the first of a list of stop ids;
    None where neither names one (lm-eval then keeps its own choice)."""
    import json

    from kvtrain.evaluate.harness import prefix_token_of
    from kvtrain.hf.export import RECORD

    assert prefix_token_of(tmp_path) is None  # not a kvtrain export
    (tmp_path / RECORD).write_text("{}")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": ')  # cut short
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert prefix_token_of(tmp_path) == 7
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": []}))
    assert prefix_token_of(tmp_path) is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert prefix_token_of(tmp_path) == 3


def test_a_record_written_over_one_with_samples_takes_its_samples_file_with_it(tmp_path):
    """``--out r.json`` again without ``--log-samples``: the first record's
    ``r.samples.jsonl`` stayed beside the new record as if its own (a probe's)."""
    from kvtrain.evaluate.report import write_record

    out = tmp_path / "r.json"
    assert write_record(out, {"tasks": "a"}, [{"x": 1}]) == [out, tmp_path / "r.samples.jsonl"]
    assert write_record(out, {"tasks": "b"}, []) == [out]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
