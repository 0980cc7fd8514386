"""``kvtrain eval`` on a Hugging Face folder: lm-evaluation-harness on two local
tasks (multiple choice, loglikelihood), offline end to end; its log-likelihoods
equal the model's own forward; refused tasks in one line.

The model is a tiny random ``LlamaForCausalLM`` with a BPE tokenizer trained
here (no download); the tasks are YAMLs in an include folder reading JSONL
files written here. Everything runs in this process (lm-eval's import and task
index are paid once); sockets are watched so that any network attempt fails
the test.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kvtrain.cli import main

from .helpers import LL, MC, NetworkWatch, check_samples, read_samples, tiny_hf_llama, write_tasks


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eval")
    return {"root": root, "hf": tiny_hf_llama(root / "hf"), "tasks": write_tasks(root)}


def kvtrain_eval(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def evaluated(local, tmp_path_factory):
    """One ``kvtrain eval`` of the HF folder on the group of both tasks, with the
    network watched."""
    mp = pytest.MonkeyPatch()
    watch = NetworkWatch(mp)
    out = tmp_path_factory.mktemp("eval_out") / "results.json"
    try:
        code = main(["eval", str(local["hf"]), "--tasks", "kvt_grp", "--include-path",
                     str(local["tasks"]), "--batch-size", "2", "--device", "cpu",
                     "--log-samples", "--out", str(out)])
    finally:
        mp.undo()
    return {"code": code, "out": out, "attempts": watch.attempts}


def test_eval_runs_offline_end_to_end(evaluated):
    assert evaluated["code"] == 0
    assert evaluated["attempts"] == []
    record = json.loads(evaluated["out"].read_text())
    assert set(record["tasks"]) == {"kvt_grp", "kvt_mc", "kvt_ll"}
    acc = {t: record["tasks"][t]["acc"] for t in record["tasks"]}
    assert acc["kvt_grp"] == pytest.approx((acc["kvt_mc"] * len(MC) + acc["kvt_ll"] * len(LL))
                                           / (len(MC) + len(LL)))
    assert record["n_samples"] == {"kvt_mc": len(MC), "kvt_ll": len(LL)}
    assert {"acc", "acc_stderr"} <= set(record["tasks"]["kvt_mc"])
    assert {"perplexity", "acc"} <= set(record["tasks"]["kvt_ll"])
    assert record["iteration"] is None and record["checkpoint"] is None
    assert record["config"]["include_path"] and record["lm_eval_version"]


def test_loglikelihoods_match_the_models_forward(evaluated, local):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(local["hf"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(local["hf"])
    check_samples(read_samples(evaluated["out"]), json.loads(evaluated["out"].read_text()),
                  lambda tokens: model(tokens).logits, tokenizer.encode)


def test_missing_dataset_is_one_line(local, capsys, monkeypatch):
    watch = NetworkWatch(monkeypatch)
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc,kvt_gone",
                                   "--include-path", str(local["tasks"])], capsys)
    assert code == 2 and watch.attempts == []
    assert len(err.strip().splitlines()) == 1, err
    assert "task 'kvt_gone'" in err and "gone.jsonl" in err and "Traceback" not in err


def test_malformed_data_file_is_one_line_naming_the_cause(local, capsys, monkeypatch):
    """A broken line in a task's data file is named as such, not as "not
    available offline" (the cause was only in a log line of datasets)."""
    watch = NetworkWatch(monkeypatch)
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_bad", "--include-path",
                                   str(local["tasks"])], capsys)
    assert code == 2 and watch.attempts == []
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvtrain: config error: task 'kvt_bad': dataset json data_files ")
    # the file and line (pyarrow's "in row 1" counted from 0 inside its read block)
    assert last.endswith(f" cannot be read: {local['root'] / 'bad.jsonl'}:2: invalid JSON at "
                         "column 13: Unterminated string starting at"), last
    assert "Traceback" not in err and "Failed to load JSON" not in err, err


def test_dataset_not_in_the_local_cache_is_one_line(local, capsys, monkeypatch):
    """A task whose hub dataset is not cached: named, no download tried."""
    watch = NetworkWatch(monkeypatch)
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_hub", "--include-path",
                                   str(local["tasks"])], capsys)
    assert code == 2 and watch.attempts == []
    assert len(err.strip().splitlines()) == 1, err
    assert ("task 'kvt_hub': dataset kvtrain-tests/never-cached is not available offline: "
            "not in the local datasets cache") in err


def test_unknown_task_is_one_line(local, capsys):
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc,no_such_task",
                                   "--include-path", str(local["tasks"])], capsys)
    assert code == 2
    assert err.strip() == ("kvtrain: config error: unknown task 'no_such_task': not one of "
                           f"lm-eval's tasks nor in --include-path {local['tasks']}")


def test_folder_without_tokenizer_is_one_line(local, capsys, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((local["hf"] / "config.json").read_text())
    code, out, err = kvtrain_eval([str(bare), "--tasks", "kvt_mc", "--include-path",
                                   str(local["tasks"])], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no tokenizer files" in err


def _with_code(local, folder, auto_map: dict, record: bool):
    """A copy of the tiny Llama folder whose config.json names folder code."""
    import shutil

    shutil.copytree(local["hf"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": auto_map}))
    (folder / "modeling_other.py").write_text("raise SystemExit('folder code ran')\n")
    if record:
        (folder / "kvtrain_export.json").write_text('{"format": "kvtrain-hf-export"}\n')
    return folder


def test_folder_code_runs_only_for_kvtrains_exports(local, tmp_path, capsys):
    """trust_remote_code only for a folder kvtrain exported (its record, and an
    auto_map naming kvtrain's modeling code); other folder code is refused in one
    line unless --trust-remote-code says to run it."""
    from kvtrain.config import ConfigError
    from kvtrain.evaluate.harness import trusts_remote_code
    from kvtrain.hf.export import AUTO_MAP

    other = {"AutoModelForCausalLM": "modeling_other.OtherForCausalLM"}
    assert trusts_remote_code(_with_code(local, tmp_path / "ours", AUTO_MAP, record=True))
    assert not trusts_remote_code(local["hf"])  # a stock Llama: no folder code at all
    for name, auto_map, record in (("no_record", AUTO_MAP, False), ("foreign", other, True)):
        folder = _with_code(local, tmp_path / name, auto_map, record)
        with pytest.raises(ConfigError, match="--trust-remote-code"):
            trusts_remote_code(folder)
        assert trusts_remote_code(folder, allow=True)
    code, out, err = kvtrain_eval([str(tmp_path / "foreign"), "--tasks", "kvt_mc",
                                   "--include-path", str(local["tasks"])], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(tmp_path / "foreign") in err and "--trust-remote-code" in err


def test_without_the_hf_extra_names_it(local, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc"], capsys)
    assert code == 2 and "pip install 'kvtrain[hf]'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--tasks", " , "], "--tasks ' , ': no task names"),
    (["--tasks", "kvt_mc", "--limit", "0"], "--limit 0.0: must be positive"),
    # a ValueError / OverflowError traceback (int() of them)
    (["--tasks", "kvt_mc", "--limit", "nan"], "--limit nan: must be positive"),
    (["--tasks", "kvt_mc", "--limit", "inf"], "--limit inf: must be positive"),
    # it scored 1 example, unsaid (a probe's)
    (["--tasks", "kvt_mc", "--limit", "1.5"], "--limit 1.5: a count of examples is a whole "
                                              "number (below 1: a fraction of each task)"),
    (["--tasks", "kvt_mc", "--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--tasks", "kvt_mc", "--num-fewshot", "-1"], "--num-fewshot -1: must be 0 or more"),
    (["--tasks", "kvt_mc", "--bootstrap-iters", "-5"], "--bootstrap-iters -5: must be 0 or more"),
    (["--tasks", "kvt_mc", "--include-path", "/no/such/tasks"],
     "--include-path /no/such/tasks: no such folder"),
])
def test_bad_options_are_one_line_before_anything_loads(local, capsys, argv, message):
    code, out, err = kvtrain_eval([str(local["hf"]), *argv], capsys)
    assert code == 2 and err.strip().startswith(f"kvtrain: config error: {message}"), err
    assert len(err.strip().splitlines()) == 1, err


def test_eval_under_torchrun_is_one_line(local, capsys, monkeypatch):
    """Under torchrun every rank exported the run and evaluated it again (its
    export's refusal then named ``kvtrain export``): ``kvtrain eval`` says it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc"], capsys)
    assert code == 2 and err.strip() == ("kvtrain: config error: kvtrain eval runs in one "
                                         "process (not under torchrun)"), err


def test_a_source_that_does_not_exist_is_named_before_the_tasks_load(capsys, tmp_path):
    """A mistyped run folder was found only after lm-eval had indexed its tasks
    (tens of seconds), and a task refusal hid it: it is the first line now."""
    missing = tmp_path / "runs" / "kv_shfit"
    code, out, err = kvtrain_eval([str(missing), "--tasks", "no_such_task"], capsys)
    assert code == 2 and err.strip() == (f"kvtrain: config error: {missing}: no such run "
                                         "folder, checkpoint or Hugging Face folder"), err
    assert out == ""


def test_out_naming_a_folder_is_one_line_before_anything_loads(local, capsys, tmp_path):
    """``--out DIR`` stopped with IsADirectoryError after the whole evaluation,
    its results lost: it is refused before any task or model loads."""
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc", "--include-path",
                                   str(local["tasks"]), "--out", str(tmp_path)], capsys)
    assert code == 2 and err.strip() == (f"kvtrain: config error: --out {tmp_path}: is a "
                                         "folder; name the results file, e.g. "
                                         f"{tmp_path / 'results.json'}"), err
    assert out == ""  # no table: nothing was evaluated


def test_out_that_cannot_be_written_is_one_line_keeping_the_results(local, capsys, tmp_path):
    """``--out`` under a file: a FileExistsError traceback after the whole evaluation,
    now one line before it, as is a folder that takes no file (/proc). A write that
    fails after the evaluation (here: a folder where the samples go): one line,
    naming the table printed above, which holds the results."""
    (tmp_path / "afile").write_text("x")
    argv = [str(local["hf"]), "--tasks", "kvt_mc", "--include-path", str(local["tasks"])]
    for target, message in (
            (tmp_path / "afile" / "x.json", f"{tmp_path}/afile is a file, not a folder"),
            ("/proc/kvtrain-eval.json", "cannot be written in /proc: No such file or directory")):
        code, out, err = kvtrain_eval([*argv, "--out", str(target)], capsys)
        assert code == 2 and err.strip().startswith(f"kvtrain: config error: --out {target}")
        assert err.strip().endswith(message) and len(err.strip().splitlines()) == 1, err
        assert out == ""  # before the evaluation
    (tmp_path / "r.samples.jsonl").mkdir()
    code, out, err = kvtrain_eval([*argv, "--log-samples", "--out", str(tmp_path / "r.json")],
                                  capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        f"kvtrain: config error: cannot write the results to {tmp_path / 'r.json'} (they are "
        "in the table above): "), err  # the lines above it: lm-eval's progress bars
    assert "kvt_mc" in out and "acc" in out


def test_a_folder_whose_weights_are_missing_or_cut_short_is_one_line(local, capsys, tmp_path):
    """transformers' OSError ('no file named model.safetensors') and safetensors'
    'incomplete metadata' were tracebacks; now one line naming the folder."""
    import shutil

    for name, damage in (("missing", lambda w: w.unlink()),
                         ("cut", lambda w: w.write_bytes(w.read_bytes()[:100000]))):
        folder = tmp_path / name
        shutil.copytree(local["hf"], folder)
        (weights,) = folder.glob("*.safetensors")
        damage(weights)
        code, out, err = kvtrain_eval([str(folder), "--tasks", "kvt_mc", "--include-path",
                                       str(local["tasks"])], capsys)
        last = err.strip().splitlines()[-1]
        assert code == 2 and last.startswith(f"kvtrain: config error: {folder}: cannot load "
                                             "its model ("), err
        assert "Traceback" not in err


def test_a_folder_whose_config_json_is_not_json_is_one_line(local, capsys, tmp_path):
    """A model folder whose config.json is cut short or not JSON: one line naming the
    file, before any task or model loads."""
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", ')
    code, out, err = kvtrain_eval([str(folder), "--tasks", "kvt_mc", "--include-path",
                                   str(local["tasks"])], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"kvtrain: config error: {folder}/config.json: cannot read it "
                          "(JSONDecodeError: ") and err.count("\n") == 1, err


HUB_NAMED_YAML = """task: kvt_named
dataset_path: kvtrain-tests/never-cached
dataset_name: sub
test_split: test
output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
"""


@pytest.mark.parametrize("task, message", [
    # a hub dataset's configuration is named with it
    ("kvt_named", "task 'kvt_named': dataset kvtrain-tests/never-cached name sub is not "
                  "available offline: not in the local datasets cache (kvtrain eval never "
                  "downloads)"),
    # a YAML without dataset_path: no dataset to name
    ("kvt_nopath", "task 'kvt_nopath': its dataset cannot be read: "),
])
def test_a_task_whose_dataset_cannot_be_loaded_names_what_it_can(local, capsys, tmp_path,
                                                                 monkeypatch, task, message):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "named.yaml").write_text(HUB_NAMED_YAML)
    (tasks / "nopath.yaml").write_text(HUB_NAMED_YAML.replace("kvt_named", "kvt_nopath").replace(
        "dataset_path: kvtrain-tests/never-cached\ndataset_name: sub\n", ""))
    watch = NetworkWatch(monkeypatch)
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", task, "--include-path",
                                   str(tasks)], capsys)
    assert code == 2 and watch.attempts == [] and err.count("\n") == 1, err
    assert err.startswith(f"kvtrain: config error: {message}"), err


def test_results_of_a_folder_outside_any_run_without_out_are_printed_not_saved(local, capsys):
    """An HF folder that is no kvtrain run's, evaluated without --out: the table,
    and one line saying the results were not saved and how to save them."""
    before = sorted(local["hf"].rglob("*"))
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc", "--include-path",
                                   str(local["tasks"]), "--limit", "2"], capsys)
    assert code == 0, err
    assert "kvt_mc" in out and "acc" in out
    # "is in no kvtrain run folder" was said of an export inside a run's eval/ too
    assert out.splitlines()[-1] == (f"kvtrain eval: results not saved ({local['hf']} is an HF "
                                    "folder, no kvtrain checkpoint: --out FILE)")
    assert sorted(local["hf"].rglob("*")) == before  # nothing written into the model's folder


FEWSHOT_EXTRA = {  # task name -> lines added to a multiple-choice YAML over two documents
    "kvt_mc2": "",  # no fewshot_split: lm-eval draws the shots from the test split
    "kvt_mc2_fs": "fewshot_split: test\n",  # the evaluated document is left out of them
    "kvt_mc2_yaml": "num_fewshot: 5\n",  # the task's own shots
}


@pytest.fixture(scope="module")
def fewshot_tasks(tmp_path_factory):
    """Tasks over a two-document mc2.jsonl, for more shots than it holds."""
    from .helpers import MC_YAML, write_jsonl

    root = tmp_path_factory.mktemp("fewshot")
    tasks = root / "tasks"
    tasks.mkdir()
    data = write_jsonl(root / "mc2.jsonl", MC[:2])
    for name, extra in FEWSHOT_EXTRA.items():
        text = MC_YAML.format(data=data, cache=root / "datasets_cache")
        (tasks / f"{name}.yaml").write_text(text.replace("task: kvt_mc\n", f"task: {name}\n")
                                            + extra)
    return tasks


@pytest.mark.parametrize("task, argv, message", [
    ("kvt_mc2", ["--num-fewshot", "5"],
     "task 'kvt_mc2': --num-fewshot 5 needs 5 few-shot examples, its test split 'test' "
     "(it has no fewshot_split) has 2"),
    ("kvt_mc2", ["--num-fewshot", "3"],
     "task 'kvt_mc2': --num-fewshot 3 needs 3 few-shot examples, its test split 'test' "
     "(it has no fewshot_split) has 2"),
    # lm-eval draws one more and drops the evaluated document: 2 shots of 2 fail too
    ("kvt_mc2_fs", ["--num-fewshot", "2"],
     "task 'kvt_mc2_fs': --num-fewshot 2 needs 2 few-shot examples, its fewshot split 'test' "
     "has 1 besides the evaluated example"),
    ("kvt_mc2_yaml", [],
     "task 'kvt_mc2_yaml': num_fewshot 5 (its YAML) needs 5 few-shot examples, its test "
     "split 'test' (it has no fewshot_split) has 2"),
])
def test_more_shots_than_the_fewshot_split_holds_is_one_line(local, fewshot_tasks, capsys,
                                                              tmp_path, task, argv, message):
    """lm-eval's 'Sample larger than population' traceback from its sampler, after the
    model had loaded: one line naming the task, the shots and what its split holds,
    before the model loads; a results file already there is kept as it was."""
    out = tmp_path / "r.json"
    out.write_text('{"kept": true}\n')
    code, stdout, err = kvtrain_eval([str(local["hf"]), "--tasks", task, "--include-path",
                                      str(fewshot_tasks), "--no-wandb", "--out", str(out),
                                      *argv], capsys)
    assert code == 2 and err == f"kvtrain: config error: {message}\n", err
    assert stdout == "" and out.read_text() == '{"kept": true}\n'


def test_a_group_names_its_task_with_too_few_shots(local, capsys):
    """kvt_grp: kvt_mc (4 documents) and kvt_ll (3): the group's task is named."""
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_grp", "--include-path",
                                   str(local["tasks"]), "--num-fewshot", "4"], capsys)
    assert code == 2 and out == "" and err == (
        "kvtrain: config error: task 'kvt_ll': --num-fewshot 4 needs 4 few-shot examples, "
        "its test split 'test' (it has no fewshot_split) has 3\n"), err


@pytest.mark.parametrize("task, shots", [("kvt_mc2", 2), ("kvt_mc2_fs", 1)])
def test_as_many_shots_as_the_fewshot_split_holds_run(local, fewshot_tasks, capsys, task,
                                                      shots):
    """The bound is lm-eval's own: all the split's documents without fewshot_split,
    all but the evaluated one with it."""
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", task, "--include-path",
                                   str(fewshot_tasks), "--num-fewshot", str(shots),
                                   "--limit", "1"], capsys)
    assert code == 0, err
    assert task in out and "acc" in out


def test_a_task_in_a_broken_yaml_names_the_file_and_line(local, capsys, tmp_path):
    """lm-eval's task index skips a YAML it cannot parse, unremarked: the task in it
    was "unknown" (a truly unknown task with no broken YAML keeps that line)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text((local["tasks"] / "mc.yaml").read_text())
    (tasks / "bad.yaml").write_text("task: kvt_bad\ndoc_to_text: [unclosed\n")
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_bad", "--include-path",
                                   str(tasks)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"kvtrain: config error: --include-path {tasks}: {tasks / 'bad.yaml'}:"
                          "3: invalid YAML: "), err
    assert "(while parsing a flow sequence from line 2)" in err, err  # where it opened
    assert "task 'kvt_bad' is in no other YAML there" in err, err


def test_a_template_error_names_the_task_and_template(local, capsys, tmp_path):
    """A field the documents lack, in a task's template: jinja2's error was reported as
    the dataset being unreadable."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    text = (local["tasks"] / "ll.yaml").read_text().replace("kvt_ll", "kvt_tpl")
    (tasks / "tpl.yaml").write_text(text.replace("{{context}}", "{{nofield.x}}"))
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_tpl", "--include-path",
                                   str(tasks)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err == ("kvtrain: config error: task 'kvt_tpl': its template doc_to_text "
                   "\"{{nofield.x}}\" cannot be applied to its documents: UndefinedError: "
                   "'nofield' is undefined\n"), err


def test_lm_evals_internals_elsewhere_leave_the_checks_to_it(monkeypatch, tmp_path):
    """The few-shot bound and the skipped-YAML hint read lm-eval 0.4.13's internals: a
    task or an index that lacks them (another lm-eval) is left to lm-eval, not an
    AttributeError traceback."""
    from lm_eval.tasks._index import TaskIndex

    from kvtrain.evaluate.harness import _skipped_yaml, check_fewshot

    assert check_fewshot([object()], 5) is None
    (tmp_path / "bad.yaml").write_text("task: [x\n")
    assert _skipped_yaml(tmp_path)  # 0.4.13: the broken file is found
    monkeypatch.delattr(TaskIndex, "_iter_yaml_files")
    assert _skipped_yaml(tmp_path) == []


def _mc_task(root, name: str, text: str):
    """``root/tasks/<name>.yaml``: a multiple-choice task over ``root/<name>.jsonl`` (``text``)."""
    from .helpers import MC_YAML

    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    data = root / f"{name}.jsonl"
    data.write_text(text)
    (tasks / f"{name}.yaml").write_text(MC_YAML.format(data=data, cache=root / "cache").replace(
        "task: kvt_mc\n", f"task: {name}\n"))
    return tasks, data


def _lines(rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


@pytest.mark.parametrize("rows, line, message", [
    # pyarrow named the row inside its block ("in row 1", counted from 0) or a position
    ([MC[0], json.dumps(MC[1])[:20]], 2, "invalid JSON at column 14: Unterminated string "
                                         "starting at"),
    ([MC[0]] * 5 + ['{"question": "x", "choices": [', MC[1]], 6,
     "invalid JSON at column 31: Expecting value"),
    ([MC[0], "", MC[1], "[1, 2]"], 4, "not a JSON object: [1, 2]"),  # blank lines are skipped
])
def test_a_broken_line_of_a_jsonl_file_is_named_by_file_and_line(local, capsys, tmp_path, rows,
                                                                  line, message):
    tasks, data = _mc_task(tmp_path, "kvt_broken", _lines(rows))
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_broken", "--include-path",
                                   str(tasks)], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kvtrain: config error: task 'kvt_broken': dataset json data_files "), err
    assert f" cannot be read: {data}:{line}: {message}" in err, err


@pytest.mark.parametrize("bad, line, message", [
    # lm-eval scored each of these 0 (a warning printing the document, or nothing)
    ({**MC[1], "answer": 5}, 3, "its target 5 is not one of its 3 choices"),
    ({**MC[1], "answer": -1}, 3, "its target '-1' is not one of its 3 choices"),
    ({**MC[1], "answer": "purple"}, 3, "its target 'purple' is not one of its 3 choices"),
    # one 1.0 makes the whole column decimals: every document's label, from the first
    ({**MC[1], "answer": 1.0}, 1, "its target '0.0' is not one of its 3 choices (an index 0-2 "
                                  "or a choice's text) (datasets reads a column with one "
                                  "number like 1.0 as decimals); lm-eval scores it 0"),
    # datasets fills a field a line lacks with null: lm-eval read the question as "None"
    ({"choices": ["hot", "blue"], "answer": 1}, 3, "field 'question' of doc_to_text "
                                                   "\"{{question}}\" is missing (null)"),
    ({**MC[1], "choices": []}, 3, "its doc_to_choice \"{{choices}}\" gives no choices"),
])
def test_a_document_lm_eval_cannot_score_is_named_before_the_model_loads(local, capsys, tmp_path,
                                                                        bad, line, message):
    """A label outside the choices, or a field a line lacks: lm-eval scored the
    document as wrong without a word (or a warning that printed the document); one
    line naming the file and line, before the model loads."""
    tasks, data = _mc_task(tmp_path, "kvt_labels", _lines([MC[0], MC[2], bad, MC[3]]))
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_labels", "--include-path",
                                   str(tasks)], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kvtrain: config error: task 'kvt_labels': {data}:{line}: "
                          f"{message}"), err


def test_only_the_documents_evaluated_are_checked(local, capsys, tmp_path):
    """--limit 2: a bad third document is not evaluated, so not refused."""
    tasks, _ = _mc_task(tmp_path, "kvt_limited",
                        _lines([MC[0], MC[2], {**MC[1], "answer": 5}]))
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_limited", "--include-path",
                                   str(tasks), "--limit", "2"], capsys)
    assert code == 0, err
    assert "kvt_limited" in out


@pytest.mark.parametrize("rows, extra, line, message", [
    # lm-eval asserted (a traceback after the model loaded): it never cuts a continuation
    ([LL[0], {"context": "the sun is", "target": " ".join(["hot"] * 80)}], "", 2,
     "its continuation ' hot hot hot hot hot hot hot hot hot ...' is 80 tokens, more than "
     "the model's window of 64 (lm-eval keeps a continuation whole); lm-eval cannot score it"),
    # no delimiter and an empty target: nothing to score
    ([LL[0], LL[1], {"context": "fish swim", "target": ""}],
     'target_delimiter: ""\ndoc_to_target: "{{target}}"\n', 3,
     "its continuation '' has no tokens; lm-eval cannot score it"),
])
def test_a_continuation_lm_eval_cannot_score_is_one_line(local, capsys, tmp_path, rows, extra,
                                                         line, message):
    from .helpers import LL_YAML, write_jsonl

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    (tasks / "long.yaml").write_text(LL_YAML.format(name="kvt_long", data=data,
                                                    cache=tmp_path / "cache") + extra)
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_long", "--include-path",
                                   str(tasks)], capsys)
    assert code == 2 and "Traceback" not in err, err
    last = err.splitlines()[-1]  # after the model's progress bars
    assert last == f"kvtrain: config error: task 'kvt_long': {data}:{line}: {message}", err


def test_device_cuda_without_cuda_is_one_line(local, capsys, monkeypatch):
    """``--device cuda`` on a machine without CUDA was lm-eval's traceback after
    the export (torch's "Torch not compiled with CUDA enabled"): one line now,
    naming the option, before anything loads."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc", "--include-path",
                                   str(local["tasks"]), "--device", "cuda"], capsys)
    assert code == 2 and err.strip() == ("kvtrain: config error: --device cuda: no CUDA "
                                         "device here (torch.cuda.is_available() is False); "
                                         "use --device cpu"), err
    assert out == ""
