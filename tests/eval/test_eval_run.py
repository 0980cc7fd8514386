"""``kvtrain eval RUN_DIR``: a kvtrain run's checkpoint (KV shift, GQA, a
sentencepiece tokenizer trained here) exported through ``kvtrain.hf`` and
evaluated by lm-evaluation-harness on two local tasks; its log-likelihoods
equal kvtrain's own forward of the checkpoint (``load_model``, the logits of
the tokenizer's vocabulary), the results land in ``RUN_DIR/eval/`` and the
run's wandb run, the export is cached, a run without a tokenizer is refused.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvtrain.cli import main
from kvtrain.config import KVShiftConfig, dump_yaml

from ..hf.helpers import build, model_config, run_config
from .helpers import LL, MC, ROLL_DOC, WORDS, check_samples, read_samples, write_tasks

SPM_VOCAB = 300  # byte fallback (256) + specials + a few merges
RUN_ID = "evaltst1"


def sentencepiece(root) -> str:
    """A sentencepiece BPE tokenizer as ``kvtrain data train-tokenizer`` makes one."""
    from data_tools import readers
    from data_tools.train_tokenizer import train

    text = root / "text.txt"
    text.write_text("\n".join([WORDS] * 40))
    train(readers.discover([str(text)]), str(root / "spm" / "tok"), SPM_VOCAB, log=lambda m: None)
    return str(root / "spm" / "tok.model")


def make_run(root, tokenizer, wandb: bool):
    """``root``: config.yaml and checkpoints/iter_0000000 of a tiny KV-shift model."""
    from kvtrain.hf.importer import save_weights

    cfg = run_config(model_config(vocab_size=SPM_VOCAB,
                                  kv_shift=KVShiftConfig(window=2, mode="gate")))
    cfg.name = root.name
    cfg.data.tokenizer = tokenizer
    cfg.wandb.enabled, cfg.wandb.mode = wandb, "offline"
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(dump_yaml(cfg))
    if wandb:
        (root / "wandb_run_id").write_text(RUN_ID + "\n")  # as the trainer left it
    return save_weights(build(cfg), cfg, root / "checkpoints" / "iter_0000000")


@pytest.fixture(scope="module")
def evaluated(single_rank, tmp_path_factory):
    """One ``kvtrain eval RUN_DIR`` on both tasks; what it logged to wandb."""
    from kvtrain.backend import init_model_parallel
    from kvtrain.train.wandb_logger import WandbLogger

    init_model_parallel(1, 1)
    root = tmp_path_factory.mktemp("eval_run")
    run = root / "run"
    checkpoint = make_run(run, sentencepiece(root), wandb=True)
    logged = []
    mp = pytest.MonkeyPatch()
    real_log = WandbLogger.log
    mp.setattr(WandbLogger, "log", lambda self, m: (logged.append(dict(m)), real_log(self, m)))
    tasks = write_tasks(root)
    try:
        code = main(["eval", str(run), "--tasks", "kvt_mc,kvt_ll", "--include-path", str(tasks),
                     "--batch-size", "2", "--device", "cpu", "--log-samples"])
    finally:
        mp.undo()
    return {"code": code, "run": run, "checkpoint": checkpoint, "logged": logged,
            "tasks": tasks, "root": root}


def test_eval_of_a_run_writes_its_results(evaluated):
    assert evaluated["code"] == 0
    run = evaluated["run"]
    record_file = run / "eval" / "kvt_mc+kvt_ll-iter_0000000.json"
    record = json.loads(record_file.read_text())
    assert record["checkpoint"] == str(evaluated["checkpoint"]) and record["iteration"] == 0
    assert record["n_samples"] == {"kvt_mc": len(MC), "kvt_ll": len(LL)}
    export = run / "eval" / "hf-iter_0000000-fp32"
    assert record["hf_dir"] == str(export)
    assert json.loads((export / "config.json").read_text())["auto_map"]  # the KV-shift code
    # logged into the run's own wandb run, at the checkpoint's iteration
    (metrics,) = evaluated["logged"]
    assert metrics["iteration"] == 0
    assert metrics["eval/kvt_mc/acc"] == record["tasks"]["kvt_mc"]["acc"]
    assert metrics["eval/kvt_ll/perplexity"] == record["tasks"]["kvt_ll"]["perplexity"]
    assert list((run / "wandb").glob(f"offline-run-*-{RUN_ID}"))


def test_loglikelihoods_match_kvtrains_forward(evaluated):
    from transformers import AutoTokenizer

    from kvtrain.inference.loading import load_model

    loaded = load_model(evaluated["checkpoint"], backend="local")
    tokenizer = AutoTokenizer.from_pretrained(evaluated["run"] / "eval" / "hf-iter_0000000-fp32")

    def logits_of(tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1])[None]
        out = loaded.model(tokens, pos, None, runtime_gather_output=True)  # [1, s, V padded]
        return out[..., :SPM_VOCAB]  # the export has the tokenizer's vocabulary only

    record_file = evaluated["run"] / "eval" / "kvt_mc+kvt_ll-iter_0000000.json"
    check_samples(read_samples(record_file), json.loads(record_file.read_text()), logits_of,
                  tokenizer.encode)


def test_a_document_scored_whole_follows_eod(evaluated):
    """lm-eval conditions a rolling log-likelihood's first token on a prefix token:
    for a kvtrain export it is EOD (how training data separates documents and
    ``kvtrain generate`` starts a prompt), not the tokenizer's BOS the model never saw."""
    from transformers import AutoTokenizer

    from kvtrain.evaluate.harness import EvalSpec, run_harness
    from kvtrain.inference.loading import load_model

    export = evaluated["run"] / "eval" / "hf-iter_0000000-fp32"
    out = run_harness(export, EvalSpec(tasks=["kvt_roll"], include_path=evaluated["tasks"],
                                       batch_size=1, bootstrap_iters=0, log_samples=True))
    (sample,) = out.samples
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.bos_token_id != tokenizer.eos_token_id
    ids = tokenizer.encode(ROLL_DOC)
    tokens = torch.tensor([[tokenizer.eos_token_id] + ids])
    model = load_model(evaluated["checkpoint"], backend="local").model
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1])[None], None,
                       runtime_gather_output=True)[..., :SPM_VOCAB]
    logp = torch.log_softmax(logits.double(), -1)[0, :-1]
    after_eod = float(logp.gather(1, torch.tensor(ids)[:, None]).sum())
    assert sample["resps"][0][0] == pytest.approx(after_eod, abs=1e-4)


def _kept_apart(evaluated, folder):
    """A copy of the run's export as a run with ``data.reset_attention_mask`` exports it."""
    import shutil

    shutil.copytree(evaluated["run"] / "eval" / "hf-iter_0000000-fp32", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "reset_attention_mask": True}))
    return folder


def test_a_document_of_a_run_that_kept_documents_apart(evaluated, tmp_path):
    """``data.reset_attention_mask``: in training a document's first token was
    predicted at the previous document's EOD, which attended only to its own
    document, and the document's tokens attended to and shifted with nothing
    before them (as ``kvtrain generate`` feeds a prompt). lm-eval scores the
    first token after an EOD alone and the rest on the document alone, not on
    one row EOD + document (whose tokens would attend to and shift with the EOD)."""
    from transformers import AutoTokenizer

    from kvtrain.evaluate.harness import EvalSpec, run_harness
    from kvtrain.inference.loading import load_model

    export = _kept_apart(evaluated, tmp_path / "apart")
    out = run_harness(export, EvalSpec(tasks=["kvt_roll"], include_path=evaluated["tasks"],
                                       batch_size=1, bootstrap_iters=0, log_samples=True))
    (sample,) = out.samples
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer.encode(ROLL_DOC)
    model = load_model(evaluated["checkpoint"], backend="local").model

    def logp(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None,
                           runtime_gather_output=True)[..., :SPM_VOCAB]
        return torch.log_softmax(logits.double(), -1)[0]

    first = float(logp([tokenizer.eos_token_id])[0, ids[0]])
    rest = float(logp(ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())
    assert sample["resps"][0][0] == pytest.approx(first + rest, abs=1e-4)


def test_a_batch_keeps_each_rows_documents_apart(evaluated, tmp_path):
    """A batch mixing a row that starts with the prefix EOD and one that does not
    (a rolling document's later window): only the first is split, each row's
    logits are those of the row alone."""
    from kvtrain.evaluate.harness import EvalSpec, language_model

    export = _kept_apart(evaluated, tmp_path / "apart")
    lm = language_model(export, EvalSpec(tasks=[]), trust=True)
    eod, doc = lm.prefix_token_id, lm.tok_encode(ROLL_DOC)[:6]
    rows = torch.tensor([[eod] + doc[:5], doc])
    got = lm._model_call(rows)
    with torch.no_grad():
        alone = [lm.model(torch.tensor([t])).logits[0] for t in ([eod], doc[:5], doc)]
    torch.testing.assert_close(got[0, :1], alone[0])
    torch.testing.assert_close(got[0, 1:], alone[1])
    torch.testing.assert_close(got[1], alone[2])


def test_second_eval_reuses_the_export(evaluated, capsys):
    weights = evaluated["run"] / "eval" / "hf-iter_0000000-fp32" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    code = main(["eval", str(evaluated["checkpoint"]), "--tasks", "kvt_ll", "--include-path",
                 str(evaluated["tasks"]), "--limit", "1", "--no-wandb", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and weights.stat().st_mtime_ns == before
    assert (evaluated["run"] / "eval" / "kvt_ll-iter_0000000-limit1.json").exists()
    assert "kvt_ll" in out and "perplexity" in out  # the printed table


def test_an_export_of_an_older_kvtrain_is_redone(evaluated, capsys):
    """A cached export from before a change of the export format (e.g. the tokenizer's
    split_special_tokens) is exported again, not scored with its old files."""
    from kvtrain.evaluate.source import STAMP

    folder = evaluated["run"] / "eval" / "hf-iter_0000000-fp32"
    stamp = json.loads((folder / STAMP).read_text())
    stamp.pop("export_version", None)  # what an older kvtrain wrote
    (folder / STAMP).write_text(json.dumps(stamp))
    before = (folder / "model.safetensors").stat().st_mtime_ns
    code = main(["eval", str(evaluated["checkpoint"]), "--tasks", "kvt_ll", "--include-path",
                 str(evaluated["tasks"]), "--limit", "1", "--no-wandb", "--device", "cpu"])
    capsys.readouterr()
    assert code == 0 and (folder / "model.safetensors").stat().st_mtime_ns != before
    assert "export_version" in json.loads((folder / STAMP).read_text())


def test_eval_of_a_checkpoints_folder_writes_into_its_run(evaluated, capsys):
    """``kvtrain eval RUN/checkpoints``: results and the export go to RUN (where
    ``kvtrain compare RUN`` reads them), not to RUN/checkpoints."""
    run = evaluated["run"]
    code = main(["eval", str(run / "checkpoints"), "--tasks", "kvt_ll", "--include-path",
                 str(evaluated["tasks"]), "--limit", "2", "--no-wandb", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    assert (run / "eval" / "kvt_ll-iter_0000000-limit2.json").is_file()
    assert not (run / "checkpoints" / "eval").exists()


def test_checkpoint_outside_any_run_saves_only_to_out(evaluated, tmp_path):
    """A checkpoint folder (checkpoint.dir) outside any run folder has no run
    folder: nothing is written beside it, results only with --out."""
    from kvtrain.evaluate.source import run_folder_of

    alone = tmp_path / "ckpts"
    (alone / "iter_0000000").mkdir(parents=True)
    assert run_folder_of(alone, alone / "iter_0000000") is None
    assert run_folder_of(alone / "iter_0000000", alone / "iter_0000000") is None
    named = evaluated["run"] / "checkpoints"
    assert run_folder_of(named, evaluated["checkpoint"]) == evaluated["run"]
    assert run_folder_of(evaluated["run"], evaluated["checkpoint"]) == evaluated["run"]


def test_a_checkpoint_outside_any_run_is_exported_aside_and_scored(evaluated, tmp_path,
                                                                   monkeypatch):
    """Its export goes to a temporary folder, removed afterwards; the results to --out
    only, the same as the run's own; nothing is written beside the checkpoint."""
    import shutil
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    alone = tmp_path / "ckpts"
    shutil.copytree(evaluated["checkpoint"], alone / "iter_0000000")
    out = tmp_path / "results.json"
    assert main(["eval", str(alone / "iter_0000000"), "--tasks", "kvt_mc,kvt_ll",
                 "--include-path", str(evaluated["tasks"]), "--batch-size", "2",
                 "--device", "cpu", "--out", str(out), "--no-wandb"]) == 0
    assert [p.name for p in alone.iterdir()] == ["iter_0000000"]
    assert list(scratch.iterdir()) == []  # the export removed
    ours = json.loads(out.read_text())
    runs = json.loads((evaluated["run"] / "eval" / "kvt_mc+kvt_ll-iter_0000000.json").read_text())
    assert ours["tasks"] == runs["tasks"] and ours["checkpoint"] == str(alone / "iter_0000000")
    assert ours["hf_dir"] is None  # it was scored on a temporary export, removed since


def test_bf16_results_keep_apart_from_fp32(evaluated, capsys):
    """``--dtype bf16`` writes its own results file (and export): the fp32 results of
    the same tasks and iteration stay; the default's name has no dtype (older names)."""
    from kvtrain.evaluate.report import record_name

    assert record_name(["kvt_ll"], 0, limit=2) == "kvt_ll-iter_0000000-limit2.json"
    run = evaluated["run"]
    argv = [str(run), "--tasks", "kvt_ll", "--include-path", str(evaluated["tasks"]),
            "--limit", "3", "--no-wandb", "--device", "cpu"]
    assert main(["eval", *argv]) == 0
    fp32 = run / "eval" / "kvt_ll-iter_0000000-limit3.json"
    before = fp32.read_text()
    assert main(["eval", *argv, "--dtype", "bf16"]) == 0, capsys.readouterr().err
    assert fp32.read_text() == before
    bf16 = json.loads((run / "eval" / "kvt_ll-iter_0000000-limit3-bf16.json").read_text())
    assert bf16["config"]["dtype"] == "bf16" and bf16["hf_dir"].endswith("hf-iter_0000000-bf16")


def test_export_folder_names_its_checkpoint(evaluated, tmp_path):
    """An HF folder kvtrain exported: the record names the checkpoint and iteration."""
    code = main(["eval", str(evaluated["run"] / "eval" / "hf-iter_0000000-fp32"), "--tasks",
                 "kvt_ll", "--include-path", str(evaluated["tasks"]), "--limit", "1",
                 "--device", "cpu", "--out", str(tmp_path / "r.json")])
    record = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and record["iteration"] == 0
    assert record["checkpoint"] == str(evaluated["checkpoint"])


def test_run_without_tokenizer_is_one_line(evaluated, capsys):
    make_run(evaluated["root"] / "ids_only", None, wandb=False)
    capsys.readouterr()  # the build's own warnings are not the command's output
    code = main(["eval", str(evaluated["root"] / "ids_only"), "--tasks", "kvt_ll",
                 "--include-path", str(evaluated["tasks"])])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "the run has no tokenizer" in err
    assert not (evaluated["root"] / "ids_only" / "eval").exists()  # refused before any export


def test_a_foreign_folder_of_kv_shift_code_runs_with_trust_remote_code(evaluated, tmp_path):
    """The path --trust-remote-code opens, end to end: a KV-shift export copied without
    kvtrain's record (so a folder kvtrain did not export, its modeling code the
    export's) is evaluated by lm-eval with the folder's own code, and scores what
    the export scored."""
    import shutil

    from kvtrain.hf.export import RECORD

    export = evaluated["run"] / "eval" / "hf-iter_0000000-fp32"
    foreign = tmp_path / "foreign"
    shutil.copytree(export, foreign)
    (foreign / RECORD).unlink()
    argv = ["eval", str(foreign), "--tasks", "kvt_mc", "--include-path", str(evaluated["tasks"]),
            "--batch-size", "2", "--device", "cpu", "--out", str(tmp_path / "r.json")]
    assert main(argv) == 2  # refused without the flag (its code is not kvtrain's export)
    assert main(argv + ["--trust-remote-code", "--log-samples"]) == 0
    ours = json.loads((evaluated["run"] / "eval" / "kvt_mc+kvt_ll-iter_0000000.json").read_text())
    theirs = json.loads((tmp_path / "r.json").read_text())
    assert theirs["tasks"]["kvt_mc"] == ours["tasks"]["kvt_mc"]
    # each answer's log-likelihood: the shift ran (a stock Llama would score otherwise)
    by_question = {tuple(map(tuple, s["arguments"])): [r[0][0] for r in s["resps"]]
                   for s in read_samples(evaluated["run"] / "eval" /
                                         "kvt_mc+kvt_ll-iter_0000000.json")
                   if s["task"] == "kvt_mc"}
    samples = read_samples(tmp_path / "r.json")
    assert len(samples) == len(MC)
    for sample in samples:
        assert [r[0][0] for r in sample["resps"]] == pytest.approx(
            by_question[tuple(map(tuple, sample["arguments"]))], abs=1e-5)


def test_a_run_whose_eval_folder_is_a_file_is_one_line(evaluated, tmp_path, capsys):
    """RUN_DIR/eval a file (where the export and the results go): a FileExistsError
    traceback; now one line naming it, before anything is evaluated."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(evaluated["run"], run, ignore=shutil.ignore_patterns("eval", "wandb*"))
    (run / "eval").write_text("notes")
    code = main(["eval", str(run), "--tasks", "kvt_ll", "--include-path",
                 str(evaluated["tasks"]), "--limit", "1", "--no-wandb", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{run / 'eval'} is a file, not a folder" in err, err
    assert (run / "eval").read_text() == "notes"


def test_a_kvtrain_export_is_scored_within_the_context_it_trained_on(evaluated, tmp_path,
                                                                    capsys):
    """lm-eval's window is the folder's ``max_position_embeddings``: a run trained on
    shorter sequences (``train.seq_length`` 16 under 64 positions) was scored on
    contexts up to 64 tokens, at positions it never trained on, without a word (its
    perplexity reads 32 tokens of context). A kvtrain export is scored within its
    ``train.seq_length`` now (the record and the table say so); ``--max-length``
    decides otherwise, and names its results file; another folder keeps lm-eval's."""
    import shutil

    from kvtrain.evaluate.harness import EvalSpec, language_model

    export = shutil.copytree(evaluated["run"] / "eval" / "hf-iter_0000000-fp32", tmp_path / "hf")
    record = json.loads((export / "kvtrain_export.json").read_text())
    record["config"]["train"]["seq_length"] = 16
    (export / "kvtrain_export.json").write_text(json.dumps(record))
    spec = EvalSpec(tasks=["kvt_ll"])
    assert language_model(export, spec, trust=True).max_length == 16
    assert language_model(export, EvalSpec(tasks=["kvt_ll"], max_length=40),
                          trust=True).max_length == 40
    (export / "kvtrain_export.json").unlink()  # a folder kvtrain did not export
    assert language_model(export, spec, trust=True).max_length == 64
    capsys.readouterr()
    assert main(["eval", str(evaluated["run"]), "--tasks", "kvt_ll", "--include-path",
                 str(evaluated["tasks"]), "--max-length", "24", "--no-wandb"]) == 0
    assert "scored within 24 tokens (--max-length)" in capsys.readouterr().out
    saved = json.loads((evaluated["run"] / "eval" / "kvt_ll-iter_0000000-len24.json").read_text())
    assert saved["max_length"] == 24 and saved["config"]["max_length"] == 24
    assert main(["eval", str(evaluated["run"]), "--tasks", "kvt_ll", "--include-path",
                 str(evaluated["tasks"]), "--max-length", "0"]) == 2
    # past the model's positions: scored where it has no position (a probe's, unsaid)
    capsys.readouterr()
    assert main(["eval", str(evaluated["run"]), "--tasks", "kvt_ll", "--include-path",
                 str(evaluated["tasks"]), "--max-length", "65", "--no-wandb"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--max-length 65 is longer than the model's max_position_embeddings (64)"), "err"
