"""A resume compares the checkpoint with the run (issue 10, item 5).

One run saves a KV-shift checkpoint; other runs resume it with a changed
config (``checkpoint.resume: PATH``, each in its own folder). A change of the
model, the sequence length, the tokenizer or the data blend stops with one
line, unless ``checkpoint.allow_config_changes`` names it; then the change is
printed and recorded in metrics.jsonl. Loading is strict: a parameter in the
checkpoint that the model does not have, or the reverse, is an error.
"""

from __future__ import annotations

import pytest

from kvtrain.config import ConfigError
from kvtrain.config.compat import check_allowed_keys, check_resume_config, config_changes
from tests.train.conftest import metrics, run, run_driver, tiny_config, write_config

SAVED = {"model": {"hidden_size": 32, "attention": "kv_shift", "backend": "local",
                   "kv_shift": {"window": 1}},
         "train": {"seq_length": 32, "seed": 1, "max_steps": 6},
         "data": {"type": "gpt", "paths": ["a"], "split": "9,1,0", "tokenizer": "t.model",
                  "seed": None}}


def changed(**edits) -> dict:
    import copy

    cfg = copy.deepcopy(SAVED)
    for key, value in edits.items():
        section, *rest = key.split("__")
        node = cfg[section]
        for part in rest[:-1]:
            node = node[part]
        node[rest[-1]] = value
    return cfg


def test_compared_keys():
    assert config_changes(SAVED, SAVED) == []
    # free to change: the schedule, the layout, the backend
    assert config_changes(SAVED, changed(train__max_steps=9, model__backend="te")) == []
    keys = [c.key for c in config_changes(SAVED, changed(
        model__kv_shift__window=2, train__seq_length=64, data__paths=["b"],
        data__tokenizer="u.model"))]
    assert keys == ["data.paths", "data.tokenizer", "model.kv_shift.window", "train.seq_length"]
    # data.seed null follows train.seed: a new train.seed is a new data order
    assert [c.key for c in config_changes(SAVED, changed(train__seed=2))] == ["data.seed"]
    # the k-hop task's options and the toy tasks' validation seed: another task, another
    # validation set (they resumed unsaid: a probe's)
    hop = changed(data__type="hop")
    hop["data"]["hop"] = {"max_hops": 8}
    hop["data"]["eval_seed"] = 7
    assert [c.key for c in config_changes(changed(data__type="hop"), hop)] == [
        "data.eval_seed", "data.hop.max_hops"]
    check_allowed_keys(["data.hop", "data.eval_seed"])  # refused as "not compared" before


def test_document_handling_is_compared():
    """data.eod_mask_loss, data.reset_attention_mask and data.eod_id change what the model
    is trained on (the loss on EOD tokens, attention across documents, where documents
    end): compared, and allowed changes come back to be printed and recorded. With a
    tokenizer, data.eod_id is null or the tokenizer's own: the tokenizer is compared."""
    no_tokenizer = changed(data__tokenizer=None, data__eod_id=5)
    keys = [c.key for c in config_changes(no_tokenizer, changed(
        data__tokenizer=None, data__eod_id=7, data__eod_mask_loss=True,
        data__reset_attention_mask=True))]
    assert keys == ["data.eod_id", "data.eod_mask_loss", "data.reset_attention_mask"]
    assert config_changes(SAVED, changed(data__eod_id=2)) == []
    saved, new = changed(data__eod_mask_loss=False), changed(data__eod_mask_loss=True)
    with pytest.raises(ConfigError, match=r"data.eod_mask_loss: False -> True"):
        check_resume_config(saved, new, [], "ckpt")
    assert [str(c) for c in check_resume_config(saved, new, ["data.eod_mask_loss"], "ckpt")] \
        == ["data.eod_mask_loss: False -> True"]


def test_kernel_choices_may_change_on_resume():
    """Which kernels compute the shift and RoPE is how the model runs, not what it is:
    a run turning a kernel off (a GPU where the Triton one fails) resumes as before."""
    saved = changed(model__rope_kernel="auto", model__kv_shift__kernel="auto",
                    model__swiglu_kernel="auto", model__cross_entropy_kernel="auto")
    assert config_changes(saved, changed(model__rope_kernel="torch",
                                         model__kv_shift__kernel="torch",
                                         model__swiglu_kernel="torch",
                                         model__cross_entropy_kernel="torch")) == []


def test_keys_newer_than_the_checkpoint_take_their_defaults():
    """A checkpoint written before a model key existed (session 6's has no
    ``model.rope_kernel``, or ``model.kv_shift.mode`` missing here) compares as
    that key's default: it resumes; a value other than the default is a change."""
    from kvtrain.config.loader import to_dict
    from kvtrain.config.schema import RunConfig

    current = to_dict(RunConfig())
    older = to_dict(RunConfig())
    del older["model"]["kv_shift"]["mode"]
    assert config_changes(older, current) == []
    current["model"]["kv_shift"]["mode"] = "gate"
    assert [str(c) for c in config_changes(older, current)] == [
        "model.kv_shift.mode: 'free' -> 'gate'"]


def test_refused_and_allowed_changes():
    new = changed(train__seq_length=64, model__attention="vanilla")
    with pytest.raises(ConfigError, match=r"model.attention: 'kv_shift' -> 'vanilla'; "
                                          r"train.seq_length: 32 -> 64"):
        check_resume_config(SAVED, new, [], "ckpt")
    with pytest.raises(ConfigError, match="model.attention"):
        check_resume_config(SAVED, new, ["train.seq_length"], "ckpt")
    changes = check_resume_config(SAVED, new, ["train", "model.attention"], "ckpt")
    assert [str(c) for c in changes] == ["model.attention: 'kv_shift' -> 'vanilla'",
                                         "train.seq_length: 32 -> 64"]
    check_allowed_keys(["model", "model.kv_shift.window", "data.paths"])
    with pytest.raises(ConfigError, match="'train.lr' is not compared"):
        check_allowed_keys(["train.lr"])


def test_a_change_of_resolved_precision_is_compared():
    """train.precision as it ran (the record's ``resolved``: auto is bf16 on a GPU,
    fp32 on a CPU). A GPU run's checkpoint continued on a CPU changed it silently;
    with the plain optimizer the load then failed as a damaged checkpoint
    ("could not be loaded: KeyError: 'pre_wd_mult'")."""
    auto = changed(train__precision="auto")
    gpu, cpu = {**auto, "resolved": {"precision": "bf16"}}, {**auto, "resolved": {"precision": "fp32"}}
    assert check_resume_config(gpu, gpu, [], "ckpt") == []
    with pytest.raises(ConfigError, match=r"^ckpt was saved by a different run: "
                                          r"train.precision: 'bf16' -> 'fp32'\. .*"
                                          r"allow_config_changes: \[train.precision\]"):
        check_resume_config(gpu, cpu, [], "ckpt")
    allowed = ["train.precision"]
    assert [str(c) for c in check_resume_config(gpu, cpu, allowed, "ckpt")] == [
        "train.precision: 'bf16' -> 'fp32'"]
    plain = {**cpu, "parallel": {"distributed_optimizer": False}}
    with pytest.raises(ConfigError, match=r"^ckpt: a change of train.precision: 'bf16' -> "
                                          r"'fp32' needs parallel.distributed_optimizer: true"):
        check_resume_config(gpu, plain, allowed, "ckpt")
    weights_only = {**plain, "checkpoint": {"load_optimizer": False}}
    assert len(check_resume_config(gpu, weights_only, allowed, "ckpt")) == 1
    # a record from before the resolved precision: an explicit setting still tells
    assert check_resume_config(auto, cpu, [], "ckpt") == []  # auto: unknown
    with pytest.raises(ConfigError, match="train.precision: 'bf16' -> 'fp32'"):
        check_resume_config(changed(train__precision="bf16"), cpu, [], "ckpt")
    check_allowed_keys(["train.precision"])


@pytest.fixture(scope="module")
def resumes(tmp_path_factory, corpus, cache_dir):
    root = tmp_path_factory.mktemp("compat")
    config = write_config(root / "c.yaml", tiny_config(
        corpus, cache_dir, train={"max_steps": 3}, checkpoint={"save_interval": 3}))
    ckpt = root / "saved" / "checkpoints" / "iter_0000003"
    vanilla_ckpt = root / "saved_vanilla" / "checkpoints" / "iter_0000003"
    cases = {
        "vanilla": (["model.attention=vanilla"], 2),
        "seq": (["train.seq_length=16"], 2),
        "hidden": (["model.hidden_size=64", "model.ffn_hidden_size=128"], 2),
        "seq_allowed": (["train.seq_length=16", "checkpoint.allow_config_changes=[train.seq_length]",
                         "train.max_steps=4"], 0),
        # allowed by the config check, refused by the strict load: the checkpoint
        # holds the shift coefficients, the vanilla model has none...
        "strict_extra": (["model.attention=vanilla",
                          "checkpoint.allow_config_changes=[model.attention]"], 2),
        # allowed by the config check, but the weights have other shapes: this was
        # "could not be loaded: CheckpointException" for every checkpoint, as if damaged
        "hidden_allowed": (["model.hidden_size=64", "model.ffn_hidden_size=128",
                            "checkpoint.allow_config_changes=[model]"], 2),
        "window_allowed": (["model.kv_shift.window=2",
                            "checkpoint.allow_config_changes=[model.kv_shift.window]"], 2),
        # the checkpoint trained at fp32 (auto on a CPU)
        "precision": (["train.precision=bf16"], 2),
        "precision_allowed": (["train.precision=bf16", "train.max_steps=4",
                               "checkpoint.allow_config_changes=[train.precision]"], 0),
        "precision_plain": (["train.precision=bf16", "parallel.distributed_optimizer=false",
                             "checkpoint.allow_config_changes=[train.precision]"], 2),
        # a decaying schedule whose end moves with the run's length (3 -> 5 steps)
        "cosine_longer": (["optimizer.lr_schedule=cosine", "train.max_steps=5"], 0),
    }
    jobs = [{"config": str(config), "run_dir": str(root / "saved")},
            {"config": str(config), "run_dir": str(root / "saved_vanilla"),
             "overrides": ["model.attention=vanilla"]}]
    jobs += [{"config": str(config), "run_dir": str(root / name), "expect": code,
              "overrides": [*overrides, f"checkpoint.resume={ckpt}"]}
             for name, (overrides, code) in cases.items()]
    # ... and the reverse: a KV-shift model from a vanilla checkpoint lacks them
    jobs.append({"config": str(config), "run_dir": str(root / "strict_missing"), "expect": 2,
                 "overrides": ["checkpoint.allow_config_changes=[model.attention]",
                               f"checkpoint.resume={vanilla_ckpt}"]})
    # an explicit start, then a rerun of the same command (a crash, a requeue)
    jobs += [{"config": str(config), "run_dir": str(root / "rerun"),
              "overrides": [f"checkpoint.resume={ckpt}", f"train.max_steps={steps}"]}
             for steps in (4, 5)]
    # a refused resume in the run's own folder (resume: auto)
    jobs.append({"config": str(config), "run_dir": str(root / "saved"), "expect": 2,
                 "overrides": ["model.attention=vanilla"]})
    # ... and a start in it with nothing left to train, the optimizer's keys changed
    jobs.append({"config": str(config), "run_dir": str(root / "saved"),
                 "overrides": ["optimizer.lr=0.123", "optimizer.weight_decay=0.0"]})
    # a train.max_steps run resumed with a smaller global batch draws more samples than
    # a fresh run of that batch: a train part of one document (epochs of a sample or
    # two) has no spare samples past what it was built for
    few = root / "few_docs" / "checkpoints" / "iter_0000004"
    jobs += [{"config": str(config), "run_dir": str(root / name), "overrides": [
        "data.split=1,999,0", "checkpoint.save_interval=null", *overrides]}
        for name, overrides in (("few_docs", ["train.max_steps=4"]),
                                ("smaller_batch", ["train.max_steps=8", "train.global_batch_size=4",
                                                   f"checkpoint.resume={few}",
                                                   f"data.cache_dir={root / 'smaller_cache'}"]))]
    result = run_driver(jobs, root / "plan.json", nproc=1)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root, result


def _error_of(result, run_dir) -> str:
    """The config error printed by the job that ran in ``run_dir``."""
    lines = [line for line in result.stderr.splitlines() if "kvtrain: config error:" in line]
    matches = [line for line in lines if str(run_dir) in line or "iter_0000003" in line]
    return "\n".join(matches)


def test_changed_model_or_sequence_length_is_refused(resumes):
    root, result = resumes
    errors = [line for line in result.stderr.splitlines() if "kvtrain: config error:" in line]
    assert any("model.attention: 'kv_shift' -> 'vanilla'" in e for e in errors), errors
    assert any("train.seq_length: 32 -> 16" in e for e in errors), errors
    assert any("model.hidden_size: 32 -> 64" in e for e in errors), errors
    for name in ("vanilla", "seq", "hidden"):
        assert metrics(root / name, None) == []  # nothing trained, nothing written


def test_a_refused_resume_leaves_the_run_folders_config(resumes):
    """config.yaml says what trained the run's checkpoints and records (kvtrain
    compare reads an arm's attention and tokens from it): a start refused in the
    run's own folder leaves it as it was, not the config that never ran."""
    from kvtrain.config import read_yaml

    root, result = resumes
    saved = read_yaml(root / "saved" / "config.yaml")
    assert saved["model"]["attention"] == "kv_shift", saved["model"]


def test_a_start_with_nothing_left_to_train_leaves_the_run_folders_config(resumes):
    """A finished run started again with other optimizer keys (free to change on
    a resume) trained nothing, yet config.yaml then named the new learning rate
    and weight decay as the run's: the file of the start that trained is kept."""
    from kvtrain.config import read_yaml

    root, result = resumes
    assert "kvtrain: nothing to do: iteration 3 >= 3 steps" in result.stdout, result.stdout[-3000:]
    optimizer = read_yaml(root / "saved" / "config.yaml")["optimizer"]
    assert optimizer["lr"] != 0.123 and optimizer["weight_decay"] != 0.0, optimizer


def test_strict_load_names_the_parameters(resumes):
    _, result = resumes
    errors = [line for line in result.stderr.splitlines() if "kvtrain: config error:" in line]
    assert any("not in this model" in e and "shift_k" in e for e in errors), errors
    assert any("not in the checkpoint" in e and "shift_k" in e for e in errors), errors


def test_an_allowed_change_of_the_weights_shapes_is_one_line_not_a_damaged_checkpoint(resumes):
    """allow_config_changes lets a model key change, but a checkpoint's tensors load
    only into tensors of their own shapes: the line names a tensor, both shapes and
    the allowed changes, and no checkpoint is called unusable."""
    _, result = resumes
    errors = [line for line in result.stderr.splitlines() if "kvtrain: config error:" in line]
    hidden = [e for e in errors if "model.hidden_size: 32 -> 64" in e and "shape" in e]
    assert len(hidden) == 1, errors
    assert ("does not fit the model: the allowed changes (model.ffn_hidden_size: 64 -> 128; "
            "model.hidden_size: 32 -> 64) change the shapes of its tensors: "
            "decoder.final_layernorm.weight is (32,) in the checkpoint and (64,) in this "
            "model (and 8 more); a checkpoint loads only into a model of its own "
            "shapes") in hidden[0], hidden[0]
    window = [e for e in errors if "model.kv_shift.window: 1 -> 2" in e and "shape" in e]
    assert len(window) == 1 and "shift_k" in window[0], errors
    assert "could not be loaded" not in result.stderr and "skipping" not in result.stderr


def test_allowed_change_is_printed_and_recorded(resumes):
    root, result = resumes
    assert "config changed since the checkpoint: train.seq_length: 32 -> 16" in result.stdout
    events = [r for r in metrics(root / "seq_allowed", "event") if "config changed" in
              r.get("message", "")]
    assert len(events) == 1 and events[0]["iteration"] == 3, events
    assert events[0]["changes"] == {"train.seq_length": [32, 16]}
    assert [r["iteration"] for r in metrics(root / "seq_allowed")] == [4]
    # the tokens go on counting: 3 steps of 8 x 32 tokens, then one of 8 x 16
    # (not 4 x 8 x 16: the count fell below the checkpoint's 768)
    assert [r["consumed_tokens"] for r in metrics(root / "seq_allowed")] == [3 * 8 * 32 + 8 * 16]


def test_a_new_batch_or_a_moved_schedule_end_is_said_and_recorded(resumes):
    """A resume with another global batch (or train.eval_iters: another validation
    set) went on without a word, config.yaml then naming the new one for the whole
    run; a decaying schedule's end moved with train.max_steps silently (a cosine
    run extended 10 -> 20 steps jumped back up from 2e-4 to 1.5e-3)."""
    root, result = resumes
    events = [r for r in metrics(root / "smaller_batch", "event") if "changes" in r]
    assert [e["changes"] for e in events] == [{"train.global_batch_size": [8, 4]}], events
    assert "config changed since the checkpoint: train.global_batch_size: 8 -> 4" in \
        result.stdout
    warned = [r["message"] for r in metrics(root / "cosine_longer", "event")
              if "learning-rate schedule" in r.get("message", "")]
    assert len(warned) == 1 and warned[0].startswith(
        "kvtrain: warning: the cosine learning-rate schedule now decays until update 5, the "
        "checkpoint's until 3 (the run's length changed): the next update's learning rate "
        "is "), warned
    assert warned[0].endswith("; optimizer.lr_decay_steps: 3 keeps its schedule")
    assert warned[0] in result.stdout
    for name in ("rerun", "seq_allowed"):  # constant schedules: nothing moved
        assert not [r for r in metrics(root / name, "event")
                    if "learning-rate schedule" in r.get("message", "")], name


def test_a_batch_or_validation_change_is_recorded_not_refused():
    saved = changed(train__global_batch_size=8, train__eval_iters=2)
    new = changed(train__global_batch_size=16, train__eval_iters=4)
    assert [str(c) for c in check_resume_config(saved, new, [], "ckpt")] == [
        "train.eval_iters: 2 -> 4", "train.global_batch_size: 8 -> 16"]
    budget = changed(train__global_batch_size=8, train__train_tokens=10_000, train__max_steps=None)
    with pytest.raises(ConfigError, match="train.global_batch_size: 8 -> 16"):  # compared
        check_resume_config(budget, dict(budget, train={**budget["train"],
                                                        "global_batch_size": 16}), [], "ckpt")
    allowed = check_resume_config(budget, dict(budget, train={**budget["train"],
                                                              "global_batch_size": 16}),
                                  ["train.global_batch_size"], "ckpt")
    assert [str(c) for c in allowed] == ["train.global_batch_size: 8 -> 16"]  # said once


def test_a_rerun_of_an_explicit_start_continues_its_own_history(resumes):
    """checkpoint.resume: PATH starts the run; the same command again continues from
    the run's own iter_4 (its marker records PATH), not from PATH's iteration 3."""
    import json

    root, result = resumes
    assert [r["iteration"] for r in metrics(root / "rerun")] == [4, 5]
    assert "this run started from it and trained on" in result.stdout
    start = root / "saved" / "checkpoints" / "iter_0000003"
    marker = json.loads((root / "rerun" / "checkpoints" / "iter_0000005" /
                         "kvtrain_checkpoint.json").read_text())
    assert marker["started_from"] == str(start.resolve())
    assert not list((root / "rerun" / "checkpoints").glob("abandoned-*"))


def test_refusal_is_one_line_on_the_command_line(resumes, tmp_path):
    root, _ = resumes
    ckpt = root / "saved" / "checkpoints" / "iter_0000003"
    result = run(["train", str(root / "c.yaml"), "--run-dir", str(tmp_path / "r"),
                  "--set", "train.seq_length=16", "--set", f"checkpoint.resume={ckpt}"])
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "train.seq_length: 32 -> 16" in errors[0], errors


def test_a_smaller_global_batch_on_resume_draws_what_it_needs(resumes):
    """4 steps of 8 samples, then 4 of 4 (train.max_steps 8): 48 samples, not the 32 a
    fresh run of 4 x 8 asks for; before the fix the data ran out after the checkpoint
    (a StopIteration traceback)."""
    root, result = resumes
    train = metrics(root / "smaller_batch")
    assert [r["iteration"] for r in train] == [5, 6, 7, 8], result.stderr[-3000:]
    assert train[-1]["consumed_samples"] == 4 * 8 + 4 * 4
    # built once, for those 48: not first for a fresh run's 32, then again
    (built,) = (root / "smaller_cache").glob("*-train-description.txt")
    assert '"num_samples": 48' in built.read_text(), built.read_text()


def test_a_change_of_precision_is_refused_or_continues_from_the_main_parameters(resumes):
    """fp32 -> bf16: refused unless allowed; allowed, the distributed optimizer's fp32
    main parameters go on (the next loss is the fp32 run's, to bf16's precision);
    the plain optimizer is refused in one line."""
    root, result = resumes
    errors = [line for line in result.stderr.splitlines() if "kvtrain: config error:" in line]
    assert any("train.precision: 'fp32' -> 'bf16'. Resume it with the saved values" in e
               for e in errors), errors
    assert any("a change of train.precision: 'fp32' -> 'bf16' needs "
               "parallel.distributed_optimizer: true" in e for e in errors), errors
    for name in ("precision", "precision_plain"):
        assert metrics(root / name, None) == []
    (step,) = metrics(root / "precision_allowed")
    fp32 = [r for r in metrics(root / "rerun") if r["iteration"] == 4]
    assert step["iteration"] == 4 and step["lm_loss"] == pytest.approx(fp32[0]["lm_loss"],
                                                                       rel=2e-2)
    events = [r for r in metrics(root / "precision_allowed", "event") if "config changed" in
              r.get("message", "")]
    assert events[0]["changes"] == {"train.precision": ["fp32", "bf16"]}


def test_a_layout_that_pads_the_vocabulary_otherwise_says_which_setting_keeps_it(tmp_path,
                                                                                 cache_dir):
    """The vocabulary is padded to a multiple of make_vocab_size_divisible_by x TP: a
    TP=1 checkpoint of 300 tokens has 320 rows, TP=2 asks for 384. That resume was
    "could not be loaded: CheckpointException" for every checkpoint, as if damaged;
    it is one line naming the setting that keeps 320 rows, and that setting resumes."""
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, model={"vocab_size": 300}, train={"max_steps": 2},
        checkpoint={"save_interval": 2}))
    saved = run_driver([{"config": str(config), "run_dir": str(tmp_path / "tp1")}],
                       tmp_path / "save.json", nproc=1)
    assert saved.returncode == 0, saved.stderr[-3000:]
    ckpt = tmp_path / "tp1" / "checkpoints" / "iter_0000002"
    resume = ["parallel.tensor=2", "train.max_steps=3", f"checkpoint.resume={ckpt}"]
    jobs = [{"config": str(config), "run_dir": str(tmp_path / "tp2"), "expect": 2,
             "overrides": resume},
            {"config": str(config), "run_dir": str(tmp_path / "tp2_kept"),
             "overrides": [*resume, "model.make_vocab_size_divisible_by=32"]}]
    result = run_driver(jobs, tmp_path / "resume.json", nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    errors = sorted({line for line in result.stderr.splitlines() if "config error" in line})
    assert errors == [
        f"kvtrain: config error: checkpoint {ckpt} does not fit the model: "
        "embedding.word_embeddings.weight is (320, 32) in the checkpoint and (384, 32) in "
        "this model (and 1 more); the vocabulary (300) is padded to a multiple of "
        "model.make_vocab_size_divisible_by x parallel.tensor (64 x 2): "
        "model.make_vocab_size_divisible_by: 32 keeps the checkpoint's 320 rows at "
        "parallel.tensor 2"], errors
    assert "could not be loaded" not in result.stderr
    assert [r["iteration"] for r in metrics(tmp_path / "tp2_kept")] == [3]
