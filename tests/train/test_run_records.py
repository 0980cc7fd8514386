"""A run's records against numbers computed apart from them: the same seed logged
every step and every 5 steps (a window's record is the mean of its steps'), and
the offline wandb file, read as wandb-core wrote it, against ``metrics.jsonl``.

Nothing else reads back what went to wandb: ``MetricsLogger`` writes both, and a
key renamed or a value dropped on the wandb side was seen nowhere.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from kvtrain.train.metrics import MetricsLogger

from .conftest import metrics, run_driver, tiny_config, write_config

TOKENS_PER_STEP = 8 * 32  # global batch x sequence length of tiny_config
_BLOCK = 32768  # wandb's transaction log: leveldb's log format, in 32 KiB blocks


def _wandb_records(path: Path):
    """The protobuf records of an offline ``run-*.wandb`` file (wandb 0.31 ships no
    Python reader: its format is leveldb's log, a 7-byte ``:W&B`` header first)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a chunk header: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros to the block's end
            pos += left
            continue
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = body if kind in (1, 2) else parts + body  # full/first, middle/last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def _wandb_history(run_dir: Path) -> tuple[list[dict], dict]:
    """(history rows without wandb's own ``_`` keys, config) of the run's one start."""
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows, config = [], {}
    for record in _wandb_records(path):
        which = record.WhichOneof("record_type")
        if which == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
        elif which in ("run", "config"):
            items = record.run.config.update if which == "run" else record.config.update
            config.update({i.key: json.loads(i.value_json) for i in items})
    return rows, config


@pytest.fixture(scope="module")
def every_step_and_every_five(tmp_path_factory, corpus, cache_dir):
    """One seed, 10 steps, validation and α/β statistics at 5 and 10, logged every
    step and every 5 steps (wandb offline), in one launch."""
    root = tmp_path_factory.mktemp("records")
    jobs = []
    for interval in (1, 5):
        cfg = tiny_config(corpus, cache_dir,
                          train={"max_steps": 10, "log_interval": interval, "eval_interval": 5,
                                 "eval_iters": 2, "kv_shift_stats_interval": 5},
                          checkpoint={"save_interval": None},
                          wandb={"enabled": True, "mode": "offline", "project": "kvtrain-tests"})
        jobs.append({"config": str(write_config(root / f"log{interval}.yaml", cfg)),
                     "run_dir": str(root / f"log{interval}")})
    result = run_driver(jobs, root / "plan.json")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root / "log1", root / "log5"


def test_a_window_record_is_the_mean_of_its_steps(every_step_and_every_five):
    each, five = every_step_and_every_five
    steps = {r["iteration"]: r for r in metrics(each)}
    assert sorted(steps) == list(range(1, 11))
    windows = metrics(five)
    assert [r["iteration"] for r in windows] == [5, 10]
    for record in windows:
        it, n = record["iteration"], record["steps_in_window"]
        assert n == 5
        window = [steps[i] for i in range(it - n + 1, it + 1)]
        assert record["lm_loss"] == pytest.approx(sum(r["lm_loss"] for r in window) / n,
                                                  rel=1e-12)
        for key in ("grad_norm", "lr", "consumed_samples", "consumed_tokens", "skipped_steps"):
            assert record[key] == steps[it][key], key  # the window's last step's
        assert record["consumed_tokens"] == it * TOKENS_PER_STEP
        assert record["consumed_samples"] == it * 8
        # the global batch's tokens (not one rank's) over the mean step time
        assert record["tokens_per_s"] == pytest.approx(TOKENS_PER_STEP / record["step_time_s"])
        assert record["tflops_per_device"] > 0 and record["mfu"] is None  # a CPU's
    for kind in ("valid", "kv_shift"):  # the same weights at 5 and 10, however logged
        a, b = metrics(each, kind), metrics(five, kind)
        assert [r["iteration"] for r in a] == [5, 10]
        for x, y in zip(a, b):
            x, y = dict(x), dict(y)
            x.pop("time"), y.pop("time")
            assert x == y
    assert metrics(five, "valid")[0]["val_tokens"] == 2 * TOKENS_PER_STEP  # eval_iters batches


def test_wandb_history_holds_the_numbers_of_metrics_jsonl(every_step_and_every_five):
    for run_dir in every_step_and_every_five:
        rows, config = _wandb_history(run_dir)
        records = metrics(run_dir, kind=None)
        want = [{k: v for k, v in MetricsLogger._wandb_view(r).items() if v is not None}
                for r in records]
        assert rows == want
        trained = [row for row in rows if "train/lm_loss" in row]
        assert [row["iteration"] for row in trained] == \
            [r["iteration"] for r in records if r["kind"] == "train"]
        assert all(row["train/lm_loss"] == r["lm_loss"] and
                   row["train/consumed_tokens"] == r["consumed_tokens"]
                   for row, r in zip(trained, metrics(run_dir)))
        # the resolved backend, as the backend event and config.yaml hold it
        (backend,) = [r for r in records if r["kind"] == "event" and "backend" in r]
        assert config["resolved"]["backend"] == backend["backend"]
        assert config["resolved"]["device"] == backend["device"] == "cpu"
        header = (run_dir / "config.yaml").read_text().splitlines()[1]
        assert header.startswith(f"# backend: {backend['backend']['name']} (")
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["seed"] == \
            config["train"]["seed"]
