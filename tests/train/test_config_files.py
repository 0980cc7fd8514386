"""Every YAML under configs/ loads and validates; malformed configs fail with one
clear line (no traceback) that names the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrain.config import load_config

from .conftest import REPO, run, write_config

CONFIGS = sorted((REPO / "configs").rglob("*.yaml")) + sorted((REPO / "configs").rglob("*.yml"))


def test_configs_folder_is_not_empty():
    assert any(p.name == "demo.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_loads_and_validates(path: Path):
    cfg = load_config(path)  # strict keys and types + RunConfig.validate
    assert cfg.train.max_steps or cfg.train.train_tokens


BASE = {"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                  "num_query_groups": 2, "ffn_hidden_size": 64, "vocab_size": 256,
                  "max_position_embeddings": 64},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 32,
                  "max_steps": 4},
        "data": {"type": "mock"}, "wandb": {"enabled": False}}


def _merge(base: dict, patch: dict) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for section, values in patch.items():
        if isinstance(values, dict) and isinstance(out.get(section), dict):
            out[section].update(values)
        else:
            out[section] = values
    return out


# (id, config patch, --set overrides, fragments the one-line error must contain)
MALFORMED = [
    ("misspelt-key", {"train": {"max_step": 5}}, [],
     ["'train.max_step'", "did you mean 'train.max_steps'"]),
    ("unknown-section", {"optimiser": {"lr": 1.0}}, [], ["'optimiser'", "'optimizer'"]),
    ("wrong-type", {"train": {"max_steps": "ten"}}, [], ["train.max_steps", "expected int"]),
    ("wrong-literal", {"model": {"attention": "shifted"}}, [],
     ["model.attention", "'vanilla', 'kv_shift'"]),
    ("heads-vs-tp", {"parallel": {"tensor": 3}}, [],
     ["model.num_attention_heads", "parallel.tensor"]),
    ("kv-heads-vs-tp", {"model": {"num_query_groups": 1}, "parallel": {"tensor": 2}}, [],
     ["model.num_query_groups", "parallel.tensor"]),
    ("layers-vs-pp", {"model": {"num_layers": 3}, "parallel": {"pipeline": 2}}, [],
     ["model.num_layers", "parallel.pipeline"]),
    ("seq-too-long", {"train": {"seq_length": 128}}, [],
     ["train.seq_length", "model.max_position_embeddings"]),
    ("batch-arithmetic", {"train": {"global_batch_size": 6, "micro_batch_size": 4}}, [],
     ["train.global_batch_size", "train.micro_batch_size"]),
    ("bad-split", {"data": {"split": "0,1,0"}}, [], ["data.split"]),
    ("wsd-needs-decay", {"optimizer": {"lr_schedule": "wsd"}}, [],
     ["optimizer.wsd_decay_steps"]),
    ("gpt-needs-paths", {"data": {"type": "gpt"}}, [], ["data.paths"]),
    ("bad-weights", {"data": {"type": "gpt", "paths": [0.5, "a", "b"]}}, [], ["data.paths"]),
    ("min-lr-above-lr", {"optimizer": {"lr": 1e-3, "min_lr": 1e-2}}, [], ["optimizer.min_lr"]),
    ("set-unknown-key", {}, ["optimizer.lrr=0.1"], ["'optimizer.lrr'", "'optimizer.lr'"]),
    ("set-wrong-type", {}, ["train.log_interval=often"], ["train.log_interval", "int"]),
    ("set-not-key-value", {}, ["train.max_steps"], ["KEY=VALUE"]),
    ("duplicate-key", "train:\n  max_steps: 1\n  max_steps: 2\n", [], ["duplicate key"]),
    ("mla-shift-head", {"model": {"num_query_groups": None, "mla": {},
                                  "kv_shift": {"heads": {"k": [7]}}}}, [],
     ["model.kv_shift.heads.k", "head 7 does not exist"]),
]


@pytest.mark.parametrize("patch,overrides,fragments",
                         [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_config_is_one_clear_line(tmp_path, patch, overrides, fragments):
    path = tmp_path / "bad.yaml"
    if isinstance(patch, str):
        path.write_text(patch)
    else:
        write_config(path, _merge(BASE, patch))
    args = ["train", str(path), "--run-dir", str(tmp_path / "run")]
    for o in overrides:
        args += ["--set", o]
    result = run(args, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvtrain: config error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # nothing was started


@pytest.mark.slow
def test_problems_found_at_startup_are_one_line_too(tmp_path, corpus, cache_dir):
    """Errors only visible once the run starts (a missing shard, a resume path that
    is not a checkpoint, a vocabulary smaller than the tokenizer's) are reported
    the same way, from inside the trainer. One launch per case would cost seconds
    each; the cases run as one process that tries them in turn."""
    from .conftest import tiny_config

    cases = {
        "missing-shard": ({"data": {"paths": [str(tmp_path / "nope" / "shard")]}},
                          ["data.paths", "does not exist"]),
        "resume-not-a-checkpoint": ({"checkpoint": {"resume": str(tmp_path)}},
                                    ["checkpoint.resume", "not a complete kvtrain checkpoint"]),
    }
    if corpus.tokenizer:
        cases["vocab-too-small"] = ({"model": {"vocab_size": 128}},
                                    ["model.vocab_size", "data.tokenizer"])
    script = tmp_path / "try_configs.py"
    lines = ["import sys", "from kvtrain.cli import main", "codes = []"]
    for name, (patch, _) in cases.items():
        cfg = tiny_config(corpus, cache_dir)
        for section, values in patch.items():
            cfg[section].update(values)
        path = write_config(tmp_path / f"{name}.yaml", cfg)
        lines.append(f"print('case {name}', file=sys.stderr, flush=True)")
        lines.append(f"codes.append(main(['train', {str(path)!r}, '--run-dir', "
                     f"{str(tmp_path / name)!r}]))")
    lines += ["print('codes', codes)", "sys.exit(0)"]
    script.write_text("\n".join(lines) + "\n")
    result = run([], script=script, timeout=180)
    assert f"codes {[2] * len(cases)}" in result.stdout, result.stdout + result.stderr
    blocks = result.stderr.split("case ")[1:]
    assert len(blocks) == len(cases), result.stderr
    for block in blocks:
        name, *rest = block.strip().splitlines()
        assert len(rest) == 1, block  # one line, no traceback
        assert rest[0].startswith("kvtrain: config error: "), rest[0]
        for fragment in cases[name][1]:
            assert fragment in rest[0], rest[0]


@pytest.mark.parametrize("where", ["--run-dir", "under --run-dir", "checkpoint.dir",
                                   "data.cache_dir", "wandb.dir"])
def test_an_output_folder_that_is_a_file_is_one_line(tmp_path, capsys, where):
    """A typo that points a folder of the run at a file is one line before
    anything starts (it was a traceback from every rank)."""
    from kvtrain.cli import main

    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    path = write_config(tmp_path / "c.yaml", BASE)
    run_dir = blocker if where == "--run-dir" else blocker / "run" if where.startswith(
        "under") else tmp_path / "run"
    args = ["train", str(path), "--run-dir", str(run_dir)]
    if "." in where:
        args += ["--set", f"{where}={blocker}/sub"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    key = "--run-dir" if "run-dir" in where else where
    value = run_dir if "run-dir" in where else f"{blocker}/sub"
    where = "" if value == blocker else f": {blocker}"
    assert err == f"kvtrain: config error: {key} {value}{where} is a file, not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "notes.txt"]


@pytest.mark.parametrize("where", ["a folder", "under a file"])
def test_a_status_file_that_cannot_be_written_is_one_line(tmp_path, capsys, where):
    """`kvtrain train --status-file` is written at the end of the training: a path
    that cannot take it is refused before the training, not after it."""
    from kvtrain.cli import main

    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    path = write_config(tmp_path / "c.yaml", BASE)
    status = tmp_path if where == "a folder" else blocker / "status"
    assert main(["train", str(path), "--run-dir", str(tmp_path / "run"),
                 "--status-file", str(status)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kvtrain: config error: --status-file " + (
        f"{tmp_path} is a folder, not a file" if where == "a folder" else
        f"{status}: {blocker} is a file, not a folder"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "notes.txt"]


def test_a_cuda_torch_on_a_host_without_gpu_adds_no_line(caplog):
    """A CUDA build of torch on a host with no GPU (a cluster's login node) logs
    "No CUDA runtime is found" when megatron imports ``torch.utils.cpp_extension``:
    nothing a user can act on, and a line before kvtrain's one-line refusals. The
    commands' ``quiet_imports`` drops that message, and only it."""
    import logging

    from kvtrain.commands.train import quiet_imports

    quiet_imports()
    quiet_imports()  # twice: one filter
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING, logger="torch.utils.cpp_extension"):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
        logger.warning("Error checking compiler version for %s", "c++")
    assert [r.getMessage() for r in caplog.records] == ["Error checking compiler version for c++"]
    assert len(logger.filters) == 1
