"""Unit tests of the trainer's pure pieces (no training)."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from kvtrain.config import ConfigError, ModelConfig, load_config


# ----------------------------------------------------------------------------- FLOPs
def test_flops_count_the_real_architecture():
    from kvtrain.train.flops import forward_flops_per_sequence, training_flops_per_step

    h, heads, groups, f, layers, s, v = 64, 8, 2, 192, 3, 16, 512
    m = ModelConfig(num_layers=layers, hidden_size=h, num_attention_heads=heads,
                    num_query_groups=groups, ffn_hidden_size=f, vocab_size=v)
    d = h // heads
    fl = forward_flops_per_sequence(m, s, v)
    # GQA: K and V are only groups*d wide
    assert fl.qkv_and_output_proj == layers * s * (2 * h * (h + 2 * groups * d) + 2 * h * h)
    assert fl.mlp == layers * s * 3 * 2 * h * f  # SwiGLU: three matrices
    assert fl.attention == layers * s * 2 * 2 * h * (s + 1) / 2  # causal: (s+1)/2 keys
    assert fl.logits == s * 2 * h * v and fl.kv_shift == 0
    kv = ModelConfig(**{**m.__dict__, "attention": "kv_shift"})
    extra = forward_flops_per_sequence(kv, s, v).kv_shift
    assert extra == layers * s * 2 * (2 * 1 + 1) * groups * d  # K and V, window 1: 3 flops/elem
    qkv = ModelConfig(**{**kv.__dict__, "kv_shift": type(kv.kv_shift)(shift=["q", "k", "v"],
                                                                      window=2)})
    assert forward_flops_per_sequence(qkv, s, v).kv_shift == layers * s * 5 * (h + 2 * groups * d)
    assert training_flops_per_step(m, s, 4, v) == 4 * 3 * fl.forward


def test_peak_of_the_gpu_names_torch_reports():
    """MFU's default peak, by torch.cuda.get_device_name (dense bf16): the PCIe and
    NVL Hopper cards are slower than the SXM ones whose names they contain."""
    from kvtrain.train.flops import peak_tflops_of

    assert peak_tflops_of("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_of("NVIDIA H200") == 989.0
    assert peak_tflops_of("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_of("NVIDIA H100 NVL") == 835.0
    assert peak_tflops_of("NVIDIA H200 NVL") == 835.0
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops_of("NVIDIA GeForce RTX 4090") is None
    # fp16 tensor cores peak as bf16's; an fp32 run's matmuls run on TF32 (TE's
    # GEMMs) or FP32 cores (PyTorch's default): no guess, the config names its peak
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB", "fp16") == 312.0
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB", "fp32") is None


def test_the_mfu_basis_is_said_whatever_it_is(monkeypatch):
    """What MFU is measured against, or why a run reports none (the CPU, an fp32 run,
    an unknown GPU): recorded with the backend, so a null mfu is never unexplained."""
    import torch

    from kvtrain.train.flops import mfu_peak

    assert mfu_peak(400.0, "fp32") == (400.0, "400 TFLOP/s per device (train.peak_tflops_per_device)")
    peak, why = mfu_peak(None, "bf16")
    assert peak is None and why.startswith("none: no GPU") and "peak_tflops_per_device" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert mfu_peak(None, "bf16") == (989.0, "989 TFLOP/s per device (NVIDIA H200's dense bf16 peak)")
    peak, why = mfu_peak(None, "fp32")
    assert peak is None and why.startswith("none: fp32") and "TF32" in why
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GeForce RTX 4090")
    peak, why = mfu_peak(None, "bf16")
    assert peak is None and "NVIDIA GeForce RTX 4090" in why


# ----------------------------------------------------------------------------- schedules
def _schedule(tmp_cfg_overrides, steps):
    from kvtrain.train.optimizer import build_scheduler, current_lr

    cfg = load_config(None, tmp_cfg_overrides)
    opt = SimpleNamespace(param_groups=[{"default_config": True, "wd_mult": 1.0},
                                        {"default_config": True, "wd_mult": 0.0}])
    sched = build_scheduler(cfg, opt, total_steps=steps)
    lrs = []
    for _ in range(steps):
        sched.step(1)
        lrs.append(current_lr(opt))
    return lrs, opt


def test_warmup_then_constant_is_the_paper_schedule():
    lrs, opt = _schedule(["optimizer.lr=1e-3", "optimizer.lr_warmup_steps=4"], 10)
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # update k uses lr*k/W
    assert lrs[4:] == pytest.approx([1e-3] * 6)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # wd_mult applied


def test_cosine_and_wsd_schedules():
    lrs, _ = _schedule(["optimizer.lr=1e-3", "optimizer.lr_warmup_steps=2",
                        "optimizer.lr_schedule=cosine", "optimizer.min_lr=1e-4"], 12)
    assert lrs[1] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    lrs, _ = _schedule(["optimizer.lr=1e-3", "optimizer.lr_warmup_steps=2",
                        "optimizer.lr_schedule=wsd", "optimizer.wsd_decay_steps=4",
                        "optimizer.min_lr=0"], 12)
    assert lrs[1:8] == pytest.approx([1e-3] * 7)  # stable
    assert lrs[-1] == pytest.approx(0.0) and lrs[8] < 1e-3  # linear decay over the last 4


# ----------------------------------------------------------------------------- data order
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sample_order_does_not_depend_on_the_layout(dp):
    from kvtrain.data.loader import PretrainingBatchSampler

    mbs, gbs, steps = 2, 8, 3
    per_rank = [list(PretrainingBatchSampler(100, 8, mbs, r, dp)) for r in range(dp)]
    micro = gbs // (mbs * dp)
    for step in range(steps):
        seen = []
        for r in range(dp):
            for m in per_rank[r][step * micro:(step + 1) * micro]:
                seen += m
        assert sorted(seen) == list(range(8 + step * gbs, 8 + (step + 1) * gbs))


def test_empty_split_part_is_refused_not_looped_on():
    from kvtrain.data.datasets import plan_split

    matrix = [(0.0, 0.969), (0.969, 0.999), (0.999, 1.0)]
    with pytest.raises(ConfigError, match="validation part 0 of the 10 documents"):
        plan_split(matrix, {"shard": 10}, (True, True, False), "969,30,1")
    # parts we never draw from are dropped without moving the others
    assert plan_split(matrix, {"shard": 1000}, (True, True, False), "x") == \
        [(0.0, 0.969), (0.969, 0.999), None]


# ----------------------------------------------------------------------------- run folder files
def test_metrics_after_the_checkpoint_are_dropped_on_resume(tmp_path):
    from kvtrain.train.metrics import truncate_after

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "iteration": i}) for i in range(1, 8)]
    path.write_text("\n".join(lines) + "\n{\"kind\": \"tr")  # a line torn by a kill
    assert truncate_after(path, 4) == (3, 1, None)  # a torn last line: no copy kept
    assert [json.loads(l)["iteration"] for l in path.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.parametrize("junk", [b"\xff\xfe\x00\x01", b"[1, 2]", b"3", b'{"iteration": "x"}',
                                  b'{"iteration": null}'])
def test_metrics_lines_that_are_no_records_are_dropped_and_kept_aside(tmp_path, junk):
    """A line that is not the trainer's (not UTF-8, not an object, no whole iteration)
    anywhere in metrics.jsonl stopped the resume with a traceback (UnicodeDecodeError,
    AttributeError, ValueError); now it is dropped and the file before kept aside."""
    from kvtrain.train.metrics import truncate_after

    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"kind": "train", "iteration": i}).encode() for i in (1, 2, 3)]
    original = b"\n".join([records[0], junk, *records[1:]]) + b"\n"
    path.write_bytes(original)
    dropped, damaged, copy = truncate_after(path, 2)
    assert (dropped, damaged) == (1, 1) and copy.read_bytes() == original
    assert path.read_bytes() == b"\n".join(records[:2]) + b"\n"


def test_a_metrics_file_that_is_a_folder_is_one_line(tmp_path):
    from kvtrain.config import ConfigError
    from kvtrain.train.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ConfigError, match="metrics.jsonl is a folder, not the run's metrics"):
        MetricsLogger(tmp_path, wandb=None, active=True)


def test_resume_resolution_and_tracker(tmp_path):
    from data_tools.fileio import atomic_write_text as write_atomic
    from kvtrain.train.checkpoint import MARKER
    from kvtrain.train.integrity import plan_resume, read_tracker

    def resolve_resume(resume, root):
        plan = plan_resume(resume, root)
        return plan.candidates[0] if plan.candidates else None

    root = tmp_path / "checkpoints"
    root.mkdir()
    assert resolve_resume("auto", root) is None and resolve_resume("none", root) is None
    done = root / "iter_0000004"
    done.mkdir()
    (done / "metadata.json").write_text("{}")
    (done / MARKER).write_text("{}")
    partial = root / "iter_0000008.incomplete"
    partial.mkdir()
    (partial / "metadata.json").write_text("{}")
    (partial / MARKER).write_text("{}")  # even with every file: its name says unfinished
    write_atomic(root / "latest", "iter_0000004\n")
    assert read_tracker(root)[0] == done == resolve_resume("auto", root) == resolve_resume(
        str(root), root) == resolve_resume(str(done), root)
    with pytest.raises(ConfigError, match="not a complete kvtrain checkpoint"):
        resolve_resume(str(partial), root)
    with pytest.raises(ConfigError, match="no such checkpoint"):
        resolve_resume(str(tmp_path / "nope"), root)
    assert not [p for p in root.iterdir() if ".tmp." in p.name]  # no temp files left
    write_atomic(root / "latest", "iter_0000008\n")  # a tracker naming no checkpoint:
    plan = plan_resume("auto", root)  # a warning, and the checkpoints in the folder
    assert plan.candidates == [done] and "not a checkpoint folder" in plan.warnings[0]
    # named explicitly, a folder whose tracker names no checkpoint is a config error
    # (one line naming the key), not a guess at what the user meant
    with pytest.raises(ConfigError, match="^checkpoint.resume: .*latest") as e:
        resolve_resume(str(root), root)
    assert "\n" not in str(e.value)


def test_explicit_resume_continues_the_history_it_started(tmp_path):
    """checkpoint.resume: PATH is the run's first start. A rerun of the same command
    (a crash, a requeue outside slurm.sbatch) continues from the run's own checkpoints
    that descend from PATH (their marker says so), not from PATH again, which would
    throw away everything trained since."""
    import json

    from kvtrain.train.checkpoint import MARKER
    from kvtrain.train.integrity import plan_resume

    def fake(path, started_from=None):
        path.mkdir(parents=True)
        (path / "metadata.json").write_text("{}")
        info = {"iteration": int(path.name[5:])}
        if started_from is not None:
            info["started_from"] = started_from
        (path / MARKER).write_text(json.dumps(info))
        return path

    init = fake(tmp_path / "other" / "iter_0000002")
    root = tmp_path / "run" / "checkpoints"
    plan = plan_resume(str(init), root)  # the first start: PATH
    assert plan.candidates == [init] and plan.explicit
    own = fake(root / "iter_0000006", started_from=str(init.resolve()))
    newer = fake(root / "iter_0000008", started_from=str(init.resolve()))
    plan = plan_resume(str(init), root)  # the rerun: its own newest, then the older, then PATH
    assert plan.candidates == [newer, own, init] and not plan.explicit
    assert "continuing from its own checkpoints" in plan.notes[0] and not plan.warnings
    # checkpoints of another origin (a rollback to PATH in a folder trained without it)
    other = tmp_path / "run2" / "checkpoints"
    fake(other / "iter_0000009")
    plan = plan_resume(str(init), other)
    assert plan.candidates == [init] and plan.explicit


# ----------------------------------------------------------------------------- KV-shift stats
def test_table5_quadrants_and_layer_means():
    from kvtrain.train.evaluation import shift_statistics

    k = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]])  # alpha1 > alpha2: heads 0, 2
    v = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.1, 0.9]])  # beta1 > beta2: head 0
    rec = shift_statistics({1: {"k": k, "v": v}, 2: {"k": k.flip(1), "v": v}}, iteration=7)
    assert rec["iteration"] == 7 and rec["kv_shift/kv_heads"] == 6
    assert rec["kv_shift/layer_01/alpha1"] == pytest.approx(0.6)
    assert rec["kv_shift/layer_02/beta2"] == pytest.approx(2.0 / 3)
    assert rec["kv_shift/quadrant/a1>a2,b1>b2"] == 1
    assert rec["kv_shift/quadrant/a1>a2,b1<=b2"] == 1 + 1
    assert rec["kv_shift/quadrant/a1<=a2,b1<=b2"] == 1 + 1
    assert rec["kv_shift/quadrant/a1<=a2,b1>b2"] == 1
    # every head's coefficients, for kvtrain compare's per-layer distribution
    assert rec["kv_shift/coefficients"]["02"]["alpha"] == k.flip(1).tolist()
    assert rec["kv_shift/coefficients"]["01"]["beta"] == v.tolist()


# ----------------------------------------------------------------------------- signals
def test_stop_signals_only_set_a_flag():
    from kvtrain.train.signals import StopRequests

    with StopRequests() as stop:
        assert stop.signal_flag == 0.0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signal_flag == 1.0 and stop.received == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # handlers restored
    assert StopRequests(exit_duration_minutes=1e-9).time_flag == 1.0


def test_ctrl_c_is_a_stop_request_and_a_second_one_quits(capfd, monkeypatch):
    """The first SIGINT sets the flag and says one line; one relayed within
    SAME_PRESS_S is the same press; a later one raises KeyboardInterrupt. A rank
    that does not announce (not a node's first) says nothing."""
    from kvtrain.train import signals
    from kvtrain.train.signals import StopRequests

    before = signal.getsignal(signal.SIGINT)
    with StopRequests() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # relayed: the same press
        assert stop.signal_flag == 1.0 and stop.received == "SIGINT"
        assert capfd.readouterr().err == signals.INTERRUPT_LINE
        monkeypatch.setattr(signals, "SAME_PRESS_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # restored
    with StopRequests(announce=False) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGUSR1"  # the first request names the stop
    assert capfd.readouterr().err == ""


# ----------------------------------------------------------------------------- wandb
def test_wandb_mode_resolution(monkeypatch, tmp_path):
    from kvtrain.config import WandbConfig
    from kvtrain.train import wandb_logger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert wandb_logger.resolve_mode(WandbConfig()) == "offline"  # no key: offline
    assert wandb_logger.resolve_mode(WandbConfig(enabled=False)) == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setattr(wandb_logger, "_host_reachable", lambda *a, **k: False)
    assert wandb_logger.resolve_mode(WandbConfig()) == "offline"  # key but no network
    monkeypatch.setattr(wandb_logger, "_host_reachable", lambda *a, **k: True)
    assert wandb_logger.resolve_mode(WandbConfig()) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_logger.resolve_mode(WandbConfig()) == "disabled"
    first = wandb_logger.run_id_for(tmp_path)
    assert first == wandb_logger.run_id_for(tmp_path) and len(first) == 8


def test_wandb_auto_mode_asks_the_self_hosted_server(monkeypatch, tmp_path):
    """``mode: auto`` with a self-hosted wandb (``WANDB_BASE_URL``, and the key that
    ``wandb login --host`` writes into ~/.netrc under that host) goes online when
    that server answers, not by whether api.wandb.ai does."""
    from kvtrain.config import WandbConfig
    from kvtrain.train import wandb_logger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine wandb.corp.example\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.corp.example:8080")
    asked = []

    def reachable(host, port=443, timeout=2.0):
        asked.append((host, port))
        return (host, port) == ("wandb.corp.example", 8080)

    monkeypatch.setattr(wandb_logger, "_host_reachable", reachable)
    assert wandb_logger.resolve_mode(WandbConfig()) == "online", asked
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.corp.example")
    assert wandb_logger.resolve_mode(WandbConfig()) == "offline"  # port 443 does not answer
    assert asked[-1] == ("wandb.corp.example", 443)


# A process that starts a wandb run: whether W&B Launch's module was loaded, and
# whether wandb applied (staged) launch inputs; ``staged``: a wrapper script
# imported the inputs module first, as manage_config_file does.
WANDB_START = """
import json, sys
from pathlib import Path
from kvtrain.config import WandbConfig
from kvtrain.train.wandb_logger import WandbLogger
applied = []
if sys.argv[1] == "staged":
    from wandb.sdk.launch.inputs import internal
    internal.StagedLaunchInputs.apply = lambda self, run: applied.append(run.id)
logger = WandbLogger(WandbConfig(mode="offline"), Path(sys.argv[2]), "t", {"a": 1})
logger.finish()
from wandb.sdk.wandb_run import Run
print(json.dumps({"run": logger.run_id, "launch": "wandb.sdk.launch" in sys.modules,
                  "applied": applied, "look": Run._detect_and_apply_job_inputs.__name__}))
"""


@pytest.mark.parametrize("staged", ["none", "staged"])
def test_wandb_starts_without_the_launch_inputs_lookup_unless_inputs_may_be_staged(
        tmp_path, staged):
    """``wandb.init`` looks for W&B Launch job inputs by importing ``wandb.sdk.launch``
    (1.5-3 s of rank 0's startup with torch and megatron loaded); inputs can only be
    staged by a script that imported their module, so without it the run starts
    without the look, and with it wandb applies them as before."""
    import subprocess
    import sys

    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    done = subprocess.run([sys.executable, "-c", WANDB_START, staged, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["run"] and got["look"] == "_detect_and_apply_job_inputs"  # put back
    if staged == "none":
        assert not got["launch"] and got["applied"] == []
    else:
        assert got["applied"] == [got["run"]]


def test_metrics_logger_sends_every_record_kind_to_wandb(tmp_path):
    """metrics.jsonl and wandb get the same numbers: train/, valid/ and kv_shift/
    names against the ``iteration`` step; strings stay out of wandb, and a
    non-finite value goes to wandb as a float but to metrics.jsonl as text (JSON
    has no inf)."""
    import json

    from kvtrain.train.metrics import MetricsLogger

    class Recorder:
        def __init__(self):
            self.rows = []

        def log(self, row):
            self.rows.append(row)

    wandb = Recorder()
    logger = MetricsLogger(tmp_path, wandb, active=True)
    logger.write({"kind": "train", "iteration": 5, "lm_loss": 2.5, "lr": 1e-3,
                  "grad_norm": float("inf"), "memory_kind": "cpu_rss"}, echo=False)
    logger.write({"kind": "valid", "iteration": 5, "val_loss": 2.25, "val_ppl": 9.49},
                 echo=False)
    logger.write({"kind": "kv_shift", "iteration": 5, "kv_shift/layer_01/alpha1": 0.7},
                 echo=False)
    logger.write({"kind": "event", "iteration": 5, "message": "stopped"}, echo=False)
    logger.close()
    assert wandb.rows == [
        {"iteration": 5, "train/lm_loss": 2.5, "train/lr": 1e-3, "train/grad_norm": float("inf")},
        {"iteration": 5, "valid/val_loss": 2.25, "valid/val_ppl": 9.49},
        {"iteration": 5, "kv_shift/layer_01/alpha1": 0.7},
        {"iteration": 5},
    ]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["grad_norm"] == "inf" and lines[3]["message"] == "stopped"


@pytest.mark.parametrize("scaler, skipped", [("constant", "nonfinite"), ("dynamic", "overflow")])
def test_an_fp16_overflow_counts_as_non_finite_under_a_constant_loss_scale(scaler, skipped):
    """A dynamic loss scale backs off after an overflow (a streak of them is normal while
    it calibrates); a constant one (``optimizer.loss_scale``) overflows again every step,
    so its overflows are non-finite steps that ``train.max_consecutive_nonfinite`` stops."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    from kvtrain.train.optimizer import guarded_step

    # (megatron's scalers keep their scale on the GPU: only their class matters here)
    grad_scaler = object.__new__(ConstantGradScaler if scaler == "constant" else DynamicGradScaler)
    inner = SimpleNamespace(grad_scaler=grad_scaler)
    for optimizer in (SimpleNamespace(prepare_grads=lambda: True, grad_scaler=grad_scaler),
                      SimpleNamespace(prepare_grads=lambda: True, chained_optimizers=[inner])):
        outcome = guarded_step(optimizer, None, loss_is_finite=True)
        assert not outcome.updated and outcome.skipped == skipped


def test_a_wandb_that_fails_to_start_or_dies_does_not_stop_training(monkeypatch, tmp_path, capsys):
    """wandb is a mirror of metrics.jsonl: a wandb.init that fails (no service, a
    timeout) or a wandb-core that dies mid-run (SIGTERM of a preemption reaches it
    too: every ``log`` then raises ``ConnectionResetError``) gives one warning and
    the run goes on without wandb, through its stop, save and ``finish``."""
    import sys

    from kvtrain.config import WandbConfig
    from kvtrain.train.wandb_logger import WandbLogger

    class DeadRun:
        def define_metric(self, *a, **k):
            pass

        def log(self, row):
            raise ConnectionResetError("Connection lost")

        def finish(self, exit_code=0):
            raise ConnectionResetError("Connection lost")

    def failing_init(**kwargs):
        raise TimeoutError("wandb service did not start")

    fake = SimpleNamespace(init=failing_init, Settings=lambda **k: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = WandbConfig(mode="offline")
    logger = WandbLogger(cfg, tmp_path, "run", {})
    assert not logger.active
    logger.log({"iteration": 1, "train/lm_loss": 2.0})
    logger.finish()
    out = capsys.readouterr().out
    assert out.count("kvtrain: warning: wandb") == 1 and "TimeoutError" in out, out

    fake.init = lambda **kwargs: DeadRun()
    logger = WandbLogger(cfg, tmp_path, "run", {})
    assert logger.active
    for it in (1, 2, 3):
        logger.log({"iteration": it, "train/lm_loss": 2.0})
    assert not logger.active
    logger.finish(exit_code=0)
    out = capsys.readouterr().out
    assert out.count("kvtrain: warning: wandb") == 1 and "ConnectionResetError" in out, out



def test_a_wandb_folder_that_cannot_be_made_loses_wandb_only(tmp_path, capsys, monkeypatch):
    """``wandb.dir`` under a file (a run folder copied from another machine, read by
    ``kvtrain eval``): one warning and no wandb, not a NotADirectoryError traceback
    (a training checks the folder at its start)."""
    import sys

    from kvtrain.config import WandbConfig
    from kvtrain.train.wandb_logger import WandbLogger

    fake = SimpleNamespace(init=lambda **kwargs: pytest.fail("wandb.init without a folder"),
                           Settings=lambda **k: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / "notes").write_text("x")
    logger = WandbLogger(WandbConfig(mode="offline", dir=str(tmp_path / "notes" / "wb")),
                         tmp_path, "run", {})
    assert not logger.active
    out = capsys.readouterr().out
    assert out.count("kvtrain: warning: wandb did not start") == 1 and "Not a directory" in out, out

def test_a_start_from_step_0_opens_a_new_wandb_run_and_a_resume_the_same(monkeypatch, tmp_path,
                                                                          capsys):
    """The run id kept in the run folder is resumed only by a run that resumes a
    checkpoint: a fresh start (checkpoints deleted, checkpoint.dir moved) logs
    steps from 0 again, which wandb would drop or mix into the old run's history.
    It gets a new id (said in one line); a fresh start without wandb forgets the
    old id, so that its later resumes do not log into the old run either."""
    import sys

    from kvtrain.config import WandbConfig
    from kvtrain.train.wandb_logger import RUN_ID_FILE, WandbLogger

    ids = []
    run = SimpleNamespace(define_metric=lambda *a, **k: None)
    fake = SimpleNamespace(init=lambda **kwargs: ids.append(kwargs["id"]) or run,
                           Settings=lambda **k: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg, stored = WandbConfig(mode="offline"), tmp_path / RUN_ID_FILE
    for fresh in (True, False, True, False):
        WandbLogger(cfg, tmp_path, "run", {}, fresh=fresh)
    assert ids[0] == ids[1] != ids[2] == ids[3], ids
    assert stored.read_text().strip() == ids[2] and len(ids[2]) == 8
    out = capsys.readouterr().out
    assert out.count("kvtrain: wandb:") == 1 and f"new wandb run {ids[2]}" in out and \
        ids[0] in out, out
    WandbLogger(WandbConfig(enabled=False), tmp_path, "run", {}, fresh=True)
    assert not stored.exists()
    WandbLogger(cfg, tmp_path, "run", {}, fresh=False)
    assert ids[4] not in ids[:4]
    # a damaged id file and no wandb: forgotten without a word (it said "logging to a
    # new wandb run", with wandb off)
    stored.write_text("not an id!\n")
    capsys.readouterr()
    WandbLogger(WandbConfig(enabled=False), tmp_path, "run", {}, fresh=True)
    assert not stored.exists() and capsys.readouterr().out == ""


@pytest.mark.parametrize("content", [b"\xff\xfe\x00bad", b"has spaces\n", b"a/b\n"])
def test_a_damaged_wandb_run_id_file_is_a_warning_and_a_new_run(monkeypatch, tmp_path, capsys,
                                                                content):
    """wandb_run_id that is not UTF-8 or not a wandb id (a bad edit, a damaged disk):
    one warning naming the file, and a new run id, not a traceback at start."""
    import sys

    from kvtrain.config import WandbConfig
    from kvtrain.train.wandb_logger import RUN_ID_FILE, WandbLogger

    ids = []
    run = SimpleNamespace(define_metric=lambda *a, **k: None)
    fake = SimpleNamespace(init=lambda **kwargs: ids.append(kwargs["id"]) or run,
                           Settings=lambda **k: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    stored = tmp_path / RUN_ID_FILE
    stored.write_bytes(content)
    WandbLogger(WandbConfig(mode="offline"), tmp_path, "run", {}, fresh=False)
    out = capsys.readouterr().out
    assert f"kvtrain: warning: {stored}" in out and "new wandb run" in out, out
    assert len(ids) == 1 and stored.read_text().strip() == ids[0] and len(ids[0]) == 8


def test_the_token_count_of_a_checkpoint_from_before_it_was_kept():
    """A checkpoint without ``consumed_tokens`` counts its samples at its own
    sequence length, which an allowed change of ``train.seq_length`` names."""
    from kvtrain.config.compat import Change
    from kvtrain.train.checkpoint import TrainState
    from kvtrain.train.loop import count_tokens_from

    t = SimpleNamespace(seq_length=16)
    fresh, kept = TrainState(), TrainState(consumed_samples=24, consumed_tokens=500)
    old = TrainState(consumed_samples=24,
                     extra={"config_changes": [Change("train.seq_length", 32, 16)]})
    for state in (fresh, kept, old):
        count_tokens_from(state, t)
    assert (fresh.consumed_tokens, kept.consumed_tokens, old.consumed_tokens) == (0, 500, 768)


def test_rng_states_saved_on_another_device_are_not_restored(mp1):
    """A GPU checkpoint's states (CUDA generators: 16 bytes) resumed on the CPU, or the
    other way round, would break the first dropout in a tensor-parallel region (the
    tracker's fork sets them on this device's generator): they are kept back, and why
    is said; this device's own states are restored."""
    from megatron.core import tensor_parallel

    from kvtrain.train.rng_states import restore_rng_state, rng_state

    tracker = tensor_parallel.get_cuda_rng_tracker()
    mine = rng_state()
    assert restore_rng_state(mine) is None
    on_gpu = {**mine, "cuda": torch.zeros(16, dtype=torch.uint8),
              "tracker": {name: torch.zeros(16, dtype=torch.uint8) for name in mine["tracker"]}}
    assert restore_rng_state(on_gpu) == "saved on a GPU"
    with tracker.fork():  # this device's generator states still in the tracker
        torch.rand(2)


def test_token_ids_are_checked_below_the_vocabulary_and_above_zero():
    """``check_token_ids``: the id named is the one outside [0, vocab) (a negative
    id from a damaged int32 shard too); an in-range batch passes."""
    import torch

    from kvtrain.config import ConfigError
    from kvtrain.train.step import check_token_ids

    check_token_ids(torch.tensor([[0, 5, 63]]), 64)
    for ids, shown in (([[0, 64]], 64), ([[-3, 5]], -3)):
        with pytest.raises(ConfigError, match=rf"a batch holds token id {shown}, outside "
                                              r"model.vocab_size \(64\)"):
            check_token_ids(torch.tensor(ids), 64)


def test_a_training_step_clamps_ids_outside_the_vocabulary_and_notes_them():
    """``ForwardStep``: ids outside the vocabulary in the tokens or the labels (the
    last label is the next sequence's first token: the tokens alone missed it) are
    noted across the step's micro batches and clamped, so that the step's
    collectives still run; ``stop_on_bad_ids`` then raises on every rank."""
    from kvtrain.train.step import ForwardStep

    step = ForwardStep(vocab_size=64)
    good = {"tokens": torch.tensor([[1, 2]]), "labels": torch.tensor([[2, 3]])}
    assert step._in_vocabulary(good) is good and step.bad_ids is None
    seen = step._in_vocabulary({"tokens": torch.tensor([[1, 2]]), "labels": torch.tensor([[2, 70]])})
    assert seen["labels"].tolist() == [[2, 63]] and step.bad_ids == (1, 70)
    step._in_vocabulary({"tokens": torch.tensor([[-2, 2]]), "labels": torch.tensor([[2, 3]])})
    assert step.bad_ids == (-2, 70)
    step.stop_on_bad_ids(False)
    assert step.bad_ids is None  # forgotten with the step


def test_a_resume_says_how_many_damaged_metrics_lines_it_dropped(tmp_path, capsys):
    """``MetricsLogger.resume_at`` names the damaged lines and where the file before
    went (kept aside though no copy was asked for)."""
    from kvtrain.train.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n[1, 2]\n{"iteration": 2}\n')
    logger = MetricsLogger(tmp_path, wandb=None, active=True)
    logger.resume_at(2)
    out = capsys.readouterr().out
    (copy,) = tmp_path.glob("metrics.jsonl.damaged-*")
    assert f"metrics: dropped 1 damaged lines of {path}" in out
    assert f"the file before is kept as {copy.name}" in out
    assert path.read_text() == '{"iteration": 1}\n{"iteration": 2}\n'


def test_a_start_that_fails_gives_the_signals_and_the_folder_back(monkeypatch, tmp_path):
    """However ``train`` ends, before the CLI says why (it may wait for the launcher
    to end this rank: ``kvtrain.cli.report``): the stop handlers are the process's
    again, so the launcher's SIGTERM ends it, and the run folder's lock is let go."""
    from kvtrain.train import loop
    from tests.train.conftest import REPO

    released = []

    class Lock:
        def release(self):
            released.append(True)

    def fails(*args):
        assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL  # the trainer's, inside
        raise RuntimeError("a start that fails")

    monkeypatch.setattr(loop, "bind_to_launcher", lambda: None)
    monkeypatch.setattr(loop, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(loop, "hold_run_folder", lambda *a, **k: Lock())
    monkeypatch.setattr(loop, "_train", fails)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="a start that fails"):
        loop.train(load_config(REPO / "configs" / "tiny.yaml", []), tmp_path / "run")
    assert signal.getsignal(signal.SIGTERM) is before and released == [True]


# ----------------------------------------------------------------------------- a full run folder
class _Rows:
    """wandb's stand-in: the rows it was given."""

    def __init__(self):
        self.rows = []

    def log(self, row):
        self.rows.append(row)


def _records(n: int, first: int = 1) -> list[dict]:
    return [{"kind": "train", "iteration": i, "lm_loss": 2.0 + i / 100} for i in
            range(first, first + n)]


def _iterations(path) -> list[int]:
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()]


def test_a_full_disk_holds_the_records_until_there_is_room(tmp_path, capsys):
    """metrics.jsonl on a full disk (a quota) mid-run: the append failed with an
    OSError traceback that ended the run (its last line torn); now the run goes on
    with one warning, the file keeps whole lines only, and the records held are
    written, in order, once there is room again."""
    from kvtrain.train.metrics import MetricsLogger
    from tests.hf.test_hf_refusals import small_files

    logger = MetricsLogger(tmp_path, wandb=_Rows(), active=True)
    for record in _records(3):
        logger.write(record, echo=False)
    path = tmp_path / "metrics.jsonl"
    whole = path.read_bytes()
    with small_files(len(whole) + 20):  # room for a piece of the next line, not all of it
        for record in _records(4, first=4):
            logger.write(record, echo=False)
        assert path.read_bytes() == whole  # no torn line
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"kvtrain: warning: metrics: writing to {path} "
                                               "failed: File too large;"), out
    assert "records are held" in out[0], out
    logger.write(_records(1, first=8)[0], echo=False)
    assert _iterations(path) == list(range(1, 9))
    assert capsys.readouterr().out.strip() == \
        f"metrics: wrote the 4 records held since iteration 4 to {path}"
    logger.close()


def test_records_the_disk_never_took_are_named_at_the_end(tmp_path, capsys):
    from kvtrain.train.metrics import MetricsLogger
    from tests.hf.test_hf_refusals import small_files

    logger = MetricsLogger(tmp_path, wandb=_Rows(), active=True)
    logger.write(_records(1)[0], echo=False)
    path = tmp_path / "metrics.jsonl"
    with small_files(path.stat().st_size):
        for record in _records(3, first=2):
            logger.write(record, echo=False)
        logger.close()
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == (f"kvtrain: warning: metrics: 3 records (iterations 2-4) could not be "
                       f"written to {path}: File too large"), out
    assert _iterations(path) == [1]


def test_a_resume_on_a_full_disk_is_one_line_and_keeps_the_records(tmp_path):
    """Dropping the records past the checkpoint needs room for the file rewritten:
    on a full disk it was an OSError traceback; now one line, the file as it was."""
    from kvtrain.output import OutputError
    from kvtrain.train.metrics import MetricsLogger
    from tests.hf.test_hf_refusals import small_files

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(6)))
    before = path.read_bytes()
    for keep_copy in (False, True):  # the copy kept of a history set aside: cut short too
        logger = MetricsLogger(tmp_path, wandb=_Rows(), active=True)
        with small_files(10), pytest.raises(OutputError) as e:
            logger.resume_at(3, keep_copy=keep_copy)
        assert str(e.value).startswith(f"metrics: dropping the records after iteration 3 "
                                       f"from {path} failed: File too large;"), e.value
        assert path.read_bytes() == before and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_a_resume_names_the_trained_iterations_no_record_stands_for(tmp_path, capsys):
    """A run whose disk stayed full to its end lost its last records (named in a
    log on that same disk, if anywhere): the next start resumed with nothing in
    metrics.jsonl marking the gap. Now one warning and one event record name the
    iterations, once; a log window the checkpoint kept is not a gap."""
    from kvtrain.train.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    lines = [{"kind": "event", "iteration": 0, "message": "backend"}] + [
        {"kind": "train", "iteration": i, "steps_in_window": 2, "lm_loss": 2.0} for i in (2, 4, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    for _ in range(2):  # the second start: the gap is named already
        logger = MetricsLogger(tmp_path, wandb=_Rows(), active=True)
        logger.resume_at(12, logged_through=10)  # the checkpoint at 12 kept 2 steps' window
        logger.close()
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"kvtrain: warning: metrics: {path} has no train records of iterations 7-10, "
                   "which were trained (their run could not write them: its log says why); an "
                   "event record names them"], out
    *_, event = map(json.loads, path.read_text().splitlines())
    assert event == {"kind": "event", "iteration": 12, "message": "metrics: no train records of "
                     "iterations 7-10 (trained, not written)", "missing_iterations": [[7, 10]],
                     "time": event["time"]}
    logger = MetricsLogger(tmp_path, wandb=_Rows(), active=True)
    logger.resume_at(6, logged_through=6)  # from an older checkpoint: its history is whole
    logger.close()
    assert capsys.readouterr().out.startswith("metrics: dropped 1 records after iteration 6 ")
    assert _iterations(path) == [0, 2, 4, 6]


def test_records_past_those_held_are_counted_as_lost(tmp_path, capsys):
    """The records held are bounded (a run on a full disk for days): those past
    the bound are counted, and said when the held ones are written."""
    from kvtrain.train.metrics import MetricsLogger
    from tests.hf.test_hf_refusals import small_files

    logger = MetricsLogger(tmp_path, wandb=_Rows(), active=True)
    logger.HELD_AT_MOST = 2
    with small_files(0):
        for record in _records(4):
            logger.write(record, echo=False)
    logger.write(_records(1, first=5)[0], echo=False)
    path = tmp_path / "metrics.jsonl"
    assert _iterations(path) == [1, 2, 5]
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"metrics: wrote the 2 records held since iteration 1 to {path} (2 more, past the "
        "2 held, are not in it)")
    logger.close()


def test_a_log_the_disk_refuses_loses_lines_not_the_run(tmp_path):
    """``LogStream``: a print onto a full disk raised OSError out of the training
    loop; now it is dropped, and the first write that works says lines may be
    missing. ``log_kept_writing`` gives the streams back once they write again."""
    import io
    import sys

    from kvtrain.train.metrics import LogStream, log_kept_writing
    from tests.hf.test_hf_refusals import small_files

    path = tmp_path / "out.log"
    with open(path, "w", buffering=1) as raw:
        log = LogStream(raw)
        print("before", file=log, flush=True)
        with small_files(path.stat().st_size):
            print("x" * 10_000, file=log, flush=True)  # past any buffer: it fails
            assert log.failed == "File too large"
        print("after", file=log, flush=True)
    lines = path.read_text().splitlines()
    assert lines[0] == "before" and lines[-2:] == [
        "kvtrain: warning: lines of this log may be missing here: writing it failed "
        "(File too large)", "after"], lines[-3:]

    streams = sys.stdout, sys.stderr
    with log_kept_writing():
        assert isinstance(sys.stdout, LogStream) and isinstance(sys.stderr, LogStream)
    assert (sys.stdout, sys.stderr) == streams

    class Full(io.StringIO):
        def flush(self):
            raise OSError(28, "No space left on device")

    sys.stdout = Full()
    try:
        with log_kept_writing():
            print("lost")
        assert isinstance(sys.stdout, LogStream) and sys.stdout.failed  # kept: no exit 1
    finally:
        sys.stdout, sys.stderr = streams


def test_a_folder_where_the_run_lock_goes_is_named(tmp_path):
    """`RUN/.kvtrain.lock` a folder: the start said the run folder "cannot be written:
    Is a directory", naming neither the lock nor what to do."""
    from kvtrain.config import ConfigError
    from kvtrain.train.runlock import LOCK_FILE, hold_run_folder

    (tmp_path / "run" / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        hold_run_folder(tmp_path / "run")
    lock = (tmp_path / "run" / LOCK_FILE).resolve()
    assert str(e.value) == (f"run folder {(tmp_path / 'run').resolve()} cannot be written: "
                            f"{lock} is a folder, not the run's lock file: move it away")
