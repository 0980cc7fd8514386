"""Layouts that combine several parallel features at once train like one process (fp32,
CPU, 4 gloo ranks), and a resume that changes ``parallel.distributed_optimizer``
says in one line that the optimizer state cannot follow.

A probe ran ~70 layouts on 4 ranks (TP {1,2,4} x PP {1,2,4} x VPP x CP {1,2,4} x DP,
sequence parallelism, distributed optimizer, overlapped reduce and gather, recompute,
vanilla / KV shift / MLA, documents, tied embeddings, GQA/MQA, the local backend):
losses and gradient norms over 3 steps matched one process to ~5e-7, every parameter's
reduced gradient to ~1e-5 (fp32 reduction order). The batched test below keeps four of the combinations no other test
runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_driver, tiny_config, write_config
from .test_step_semantics import _run

# 4 layers (PP 2 x 2 virtual stages), GQA 4 heads / 2 KV heads, 8 sequences of 32 a step
MODEL = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "backend": "torch"}
LAYOUTS = [
    # documents split per CP rank under TP with sequence parallelism, masked EOD loss
    ({"tensor": 2, "context": 2, "sequence_parallel": True},
     {"data": {"reset_attention_mask": True, "eod_mask_loss": True}}),
    # interleaved pipeline at DP 2 with overlapped reduce / gather and tied embeddings
    ({"pipeline": 2, "virtual_pipeline": 2, "overlap_grad_reduce": True,
      "overlap_param_gather": True}, {"model": {"untie_embeddings": False}}),
    # TP x PP with SP, full recompute and the shift on selected heads only
    ({"tensor": 2, "pipeline": 2, "sequence_parallel": True, "recompute": "full"},
     {"model": {"kv_shift": {"heads": {"k": [0], "v": [1]}}}}),
    # CP x PP with one KV head and a window-2 clamped shift (its halo crosses CP ranks)
    ({"context": 2, "pipeline": 2, "distributed_optimizer": False},
     {"model": {"num_query_groups": 1, "kv_shift": {"mode": "clamp", "window": 2}}}),
]


def _config(cache_dir, parallel: dict, extra: dict) -> dict:
    sections = {"model": {**MODEL, **extra.get("model", {})},
                "data": {"num_workers": 0, **extra.get("data", {})},
                "train": {"micro_batch_size": 1}}
    if parallel:
        sections["parallel"] = parallel
    return tiny_config(None, cache_dir, **sections)


def _losses_and_norms(run, steps: int) -> list:
    """Per step (loss, gradient norm), through the trainer's forward step (documents)."""
    from kvtrain.train.loop import _data_iterators
    from kvtrain.train.step import ForwardStep, train_step

    t = run.cfg.train
    iterators = _data_iterators(run, 0)
    forward = ForwardStep(None, run.documents, vocab_size=run.cfg.model.vocab_size)
    results = []
    for step in range(1, steps + 1):
        forward.iteration = step
        r = train_step(run.forward_backward, forward, iterators, run.model, run.optimizer,
                       run.scheduler, run.num_microbatches, t.seq_length, t.micro_batch_size,
                       (0.0, 0.0))
        results.append((r.loss, r.outcome.grad_norm))
    return results


def _grid_worker(rank: int, world: int, cfgs: list, run_dir: str) -> list:
    return [_losses_and_norms(_run(cfg, Path(run_dir) / str(i)), 3) for i, cfg in enumerate(cfgs)]


@pytest.mark.slow
def test_combined_layouts_train_like_one_process(tmp_path, cache_dir):
    from kvtrain.testing import run_distributed

    cfgs = [_config(cache_dir, parallel, extra) for parallel, extra in LAYOUTS]
    refs = [_config(cache_dir, {}, extra) for _, extra in LAYOUTS]
    for ref in refs:  # one process: the same global batches in 4 micro batches of 2
        ref["train"]["micro_batch_size"] = 2
    (reference,) = run_distributed(_grid_worker, 1, refs, str(tmp_path / "one"))
    ranks = run_distributed(_grid_worker, 4, cfgs, str(tmp_path / "four"))
    for rank in ranks:
        for (parallel, _), got, want in zip(LAYOUTS, rank, reference):
            assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in want],
                                                              rel=1e-5), parallel
            assert [norm for _, norm in got] == pytest.approx([norm for _, norm in want],
                                                              rel=1e-5), parallel


def test_a_change_of_distributed_optimizer_is_one_line(tmp_path, cache_dir):
    """The distributed optimizer and megatron's plain one save their state in other
    forms, and neither loads the other's: the resume called a good checkpoint
    unusable ("could not be loaded: KeyError: 'pre_wd_mult'" one way, "ValueError:
    Different dict keys encountered in `apply_factory_merges`" the other) and told
    the user to repair or remove it. Its weights still load (load_optimizer false)."""
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 3}, checkpoint={"save_interval": 2}))
    jobs = []
    for saved in (True, False):
        run_dir, flag = tmp_path / f"saved_{saved}", f"parallel.distributed_optimizer={saved}"
        other = f"parallel.distributed_optimizer={not saved}"
        jobs += [{"config": str(config), "run_dir": str(run_dir), "expect": 0,
                  "overrides": [flag, "train.max_steps=2"]},
                 {"config": str(config), "run_dir": str(run_dir), "expect": 2,
                  "overrides": [other], "log": str(tmp_path / f"refused_{saved}.log")}]
    jobs.append({"config": str(config), "run_dir": str(tmp_path / "saved_True"),
                 "overrides": ["parallel.distributed_optimizer=false",
                               "checkpoint.load_optimizer=false"]})
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for saved in (True, False):
        text = (tmp_path / f"refused_{saved}.log").read_text()
        lines = [line for line in text.splitlines()
                 if line.startswith("kvtrain:") and "error" in line]
        assert len(lines) == 1 and "Traceback" not in text, text[-2000:]
        assert (f"was saved with parallel.distributed_optimizer: {str(saved).lower()}, this "
                f"run has {str(not saved).lower()}") in lines[0], lines[0]
        assert "checkpoint.load_optimizer: false" in lines[0], lines[0]
        assert "could not be loaded" not in text and "repair or remove" not in text, text[-2000:]


def _build_refused(rank: int, world: int, cfg: dict, run_dir: str) -> str:
    from kvtrain.config import ConfigError

    try:
        _run(cfg, Path(run_dir))
    except ConfigError as e:
        return f"ConfigError: {e}"
    except Exception as e:  # what the refusal was before: megatron's own
        return f"{type(e).__name__}: {e}"
    return "built"


def test_a_layout_the_world_cannot_hold_is_refused_before_megatrons_groups(single_rank,
                                                                         tmp_path, cache_dir):
    """``build_run`` of a config never validated (the Python API: kvtrain train
    validates first) with TP 3 on 2 ranks: megatron's groups were made first, and
    refused it with their RuntimeError; the config's own line comes first now."""
    from kvtrain.testing import run_distributed

    cfg = tiny_config(None, cache_dir, model={"num_attention_heads": 6,
                                              "num_query_groups": 3, "hidden_size": 48},
                      parallel={"tensor": 3})
    for result in run_distributed(_build_refused, 2, cfg, str(tmp_path / "r")):
        assert result.startswith("ConfigError: ") and "parallel.tensor" in result, result
