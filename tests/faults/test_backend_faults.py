"""Backends: chosen once, printed and recorded, refused where they would be wrong.

Issue 10 items 8 (silent fallbacks: ``model.backend``, the CPU backend on a GPU
job), 7 (document masks the GPU kernels ignore), 6 (context parallelism:
misconfigurations refused in one line) and 11 (the plan's memory model follows the
backend). The decisions are pure functions, called here with fake inputs (what
the environment, the device files, torch and Transformer Engine would say); two
subprocess launches check what a user sees from ``kvtrain train``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kvtrain.config import ConfigError, load_config
from kvtrain.plan import PlanError, make_plan, render
from kvtrain.plan.memory import activation_bytes, estimate_memory, layer_activation_bytes
from tests.train.conftest import metrics, run, tiny_config, write_config

PAPER_6_7B = "configs/paper/6.7b_kv_shift.yaml"
TE_NOT_INSTALLED = "not installed"  # kvtrain.config.backend.TE_NOT_INSTALLED


def one_line_error(result) -> str:
    """The stderr of a refused launch: exactly one line, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------- item 8: model.backend
def test_backend_key_is_typed_and_defaults_to_auto():
    assert load_config(None).model.backend == "auto"
    assert load_config(None, ["model.backend=local"]).model.backend == "local"
    assert load_config(None, ["model.backend=torch"]).model.backend == "torch"
    with pytest.raises(ConfigError,
                       match="model.backend: expected one of 'auto', 'te', 'torch', 'local'"):
        load_config(None, ["model.backend=flash"])


@pytest.mark.parametrize("requested, cuda, te_error, name, reason", [
    ("auto", False, TE_NOT_INSTALLED, "torch", "auto: no GPU"),
    ("auto", True, TE_NOT_INSTALLED, "torch", "auto: Transformer Engine not installed"),
    ("auto", True, "OSError: libcudnn.so.9: cannot open shared object file", "torch",
     "auto: transformer_engine import failed: OSError: libcudnn.so.9: cannot open shared "
     "object file"),
    ("auto", True, None, "te", "auto: Transformer Engine on a GPU"),
    ("local", True, None, "local", "model.backend: local"),
    ("torch", True, None, "torch", "model.backend: torch"),
    ("torch", False, None, "torch", "model.backend: torch"),
    ("te", True, None, "te", "model.backend: te"),
])
def test_auto_resolution_says_why(requested, cuda, te_error, name, reason):
    from kvtrain.config.backend import decide_backend

    choice = decide_backend(requested, cuda=cuda, te_error=te_error, fused_softmax=False)
    assert (choice.name, choice.reason) == (name, reason)
    assert choice.describe().startswith(f"backend {name} ({reason}")
    # a broken install is shown even when auto falls back; "not installed" is not
    broken = te_error not in (None, TE_NOT_INSTALLED) and cuda and requested == "auto"
    assert (choice.warning is not None) == broken
    if broken:
        assert te_error in choice.warning and "\n" not in choice.warning


@pytest.mark.parametrize("cuda, te_error, found", [
    (True, TE_NOT_INSTALLED, "Transformer Engine is not installed"),
    (True, "ImportError: undefined symbol: cudnnGetVersion", "undefined symbol: cudnnGetVersion"),
    (False, None, "torch sees no GPU"),
])
def test_te_requested_but_unusable_is_one_line_naming_the_key(cuda, te_error, found):
    from kvtrain.config.backend import decide_backend

    with pytest.raises(ConfigError) as e:
        decide_backend("te", cuda=cuda, te_error=te_error, fused_softmax=False)
    message = str(e.value)
    assert message.startswith("model.backend: te") and found in message and "\n" not in message


def test_te_import_error_is_classified():
    from kvtrain.config.backend import TE_NOT_INSTALLED as NOT_INSTALLED
    from kvtrain.model.specs import describe_import_failure

    assert NOT_INSTALLED == TE_NOT_INSTALLED
    missing = ModuleNotFoundError("No module named 'transformer_engine'", name="transformer_engine")
    assert describe_import_failure(missing) == TE_NOT_INSTALLED
    partial = ModuleNotFoundError("No module named 'transformer_engine_torch'",
                                  name="transformer_engine_torch")
    assert describe_import_failure(partial) == \
        "ModuleNotFoundError: No module named 'transformer_engine_torch'"
    broken = OSError("libcudart.so.12: cannot open shared object file\nmore detail")
    assert describe_import_failure(broken) == \
        "OSError: libcudart.so.12: cannot open shared object file"


def test_build_time_choice_uses_the_probes(monkeypatch):
    """The trainer's one call: probes torch, TE and apex, then decides (here: faked)."""
    from kvtrain.model import specs

    monkeypatch.setattr(specs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(specs, "te_import_error", lambda: "OSError: libnvrtc.so: not found")
    monkeypatch.setattr(specs, "fused_softmax_available", lambda: True)
    choice = specs.backend_choice("auto")
    assert (choice.name, choice.fused_softmax) == ("torch", True)
    assert "libnvrtc.so" in choice.reason and choice.warning


# ----------------------------------------------------------------------------- item 8: the device
def fake_devices(*paths: str):
    return lambda pattern: [p for p in paths if Path(p).match(pattern)]


@pytest.mark.parametrize("environ, devices, evidence", [
    ({}, (), []),
    ({"CUDA_VISIBLE_DEVICES": ""}, (), []),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, (), []),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, (), []),
    # what SLURM sets for a job without GPU gres on a node that has some
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles", "GPU_DEVICE_ORDINAL": "NoDevFiles"}, (), []),
    ({"SLURM_GPUS_PER_NODE": "0", "SLURM_JOB_ID": "7"}, (), []),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, (), ["CUDA_VISIBLE_DEVICES=0,1"]),
    ({"SLURM_JOB_GPUS": "2"}, (), ["SLURM_JOB_GPUS=2"]),
    ({"SLURM_GPUS_ON_NODE": "8"}, (), ["SLURM_GPUS_ON_NODE=8"]),
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, (), ["SLURM_GPUS_PER_NODE=a100:4"]),
    ({"GPU_DEVICE_ORDINAL": "0"}, (), ["GPU_DEVICE_ORDINAL=0"]),
    ({}, ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"), ["/dev/nvidia0", "/dev/nvidia1"]),
])
def test_gpus_given_reads_environment_and_device_files(environ, devices, evidence):
    from kvtrain.backend.device import gpus_given

    assert gpus_given(environ, fake_devices(*devices)) == evidence


def test_cpu_backend_refused_when_the_launcher_gave_gpus():
    from kvtrain.backend.device import select_device

    cpu_build = {"cuda_available": False, "torch_cuda": None}
    given = {"CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(ConfigError) as e:
        select_device("auto", given, fake_devices("/dev/nvidia0"), **cpu_build)
    message = str(e.value)
    for needle in ("CUDA_VISIBLE_DEVICES=0", "/dev/nvidia0", "torch sees no GPU",
                   "CPU-only build", "train.device: cpu"):
        assert needle in message, needle
    assert "\n" not in message
    broken_cuda = {"cuda_available": False, "torch_cuda": "12.8"}
    with pytest.raises(ConfigError, match="built for CUDA 12.8"):
        select_device("auto", given, fake_devices(), **broken_cuda)
    # the opt-out, and the plain CPU machine
    assert select_device("cpu", given, fake_devices("/dev/nvidia0"), **cpu_build) == "cpu"
    assert select_device("auto", {}, fake_devices(), **cpu_build) == "cpu"
    with pytest.raises(ConfigError, match="train.device: cuda"):
        select_device("cuda", {}, fake_devices(), **cpu_build)
    gpu = {"cuda_available": True, "torch_cuda": "12.8"}
    assert select_device("auto", given, fake_devices(), **gpu) == "cuda"
    with pytest.raises(ConfigError, match="train.device: cpu"):
        select_device("cpu", given, fake_devices(), **gpu)


# --------------------------------------------------------------------------- item 7: document masks
def masked(seq_length: int = 1024, **model) -> "object":
    sets = ["data.reset_attention_mask=true", "data.eod_id=0", f"train.seq_length={seq_length}",
            f"model.max_position_embeddings={max(seq_length, 2048)}"]
    return load_config(None, sets + [f"model.{k}={v}" for k, v in model.items()])


def choice(name: str, fused: bool):
    from kvtrain.config.backend import BackendChoice

    return BackendChoice(name=name, requested="auto", reason="test", fused_softmax=fused)


def test_mla_over_tp_without_sp_is_refused_on_te():
    """megatron's TE MLA spec makes the K/V down projection a duplicated TELinear:
    without SP its weight's gradient is not summed over TP, nor is the RoPE key's
    (shared by all heads, each rank's heads add only theirs); the torch/local twin
    of that was 1e-3..1e-2 off in every weight before the layer (kvtrain/model/mla.py
    mends it there). Not testable without TE: refused, with the ways that work."""
    from kvtrain.config.backend import check_te_mla

    mla = ["model.mla.kv_lora_rank=16", "model.mla.qk_head_dim=8",
           "model.mla.qk_pos_emb_head_dim=8", "model.mla.v_head_dim=8"]
    cfg = load_config(None, [*mla, "parallel.tensor=2"], world_size=2)
    with pytest.raises(ConfigError) as e:
        check_te_mla(cfg, choice("te", False))
    assert str(e.value) == (
        "model.mla with parallel.tensor 2 on model.backend te (the backend is te: test) needs "
        "parallel.sequence_parallel: true: without it megatron's duplicated K/V down "
        "projection leaves its weight's and the shared RoPE key's gradients unsummed over "
        "TP; or use model.backend torch")
    check_te_mla(cfg, choice("torch", False))  # mended there
    check_te_mla(load_config(None, [*mla, "parallel.tensor=2", "parallel.sequence_parallel=true"],
                             world_size=2), choice("te", False))
    check_te_mla(load_config(None, mla), choice("te", False))  # TP 1
    check_te_mla(load_config(None, ["parallel.tensor=2"], world_size=2), choice("te", False))


def test_document_masks_refused_where_the_kernel_ignores_them():
    from kvtrain.config.backend import check_document_masks

    # local with apex's fused upper-triangular softmax, 16 < s <= 4096, 16-bit
    with pytest.raises(ConfigError) as e:
        check_document_masks(masked(4096), choice("local", True), half=True)
    message = str(e.value)
    assert message.startswith("data.reset_attention_mask") and "fused softmax" in message
    assert "model.backend: torch" in message and "\n" not in message
    # te separates documents by THD packing, torch by its own masks
    check_document_masks(masked(), choice("te", False), half=True)
    check_document_masks(masked(), choice("torch", True), half=True)
    # where the mask is applied: the torch softmax (no apex, fp32, or s > 4096), the CPU
    check_document_masks(masked(1024), choice("local", False), half=True)
    check_document_masks(masked(1024), choice("local", True), half=False)
    check_document_masks(masked(8192), choice("local", True), half=True)
    check_document_masks(load_config(None), choice("te", True), half=True)  # no mask asked


def test_plan_takes_document_masks_on_te_and_torch_and_warns_on_local():
    cfg = load_config(PAPER_6_7B, ["data.reset_attention_mask=true", "data.eod_id=2"])
    assert make_plan(cfg, nodes=8, gpu="a100").memory.attention == "te"  # THD packing
    cfg = load_config(PAPER_6_7B, ["data.reset_attention_mask=true", "data.eod_id=2",
                                   "model.backend=torch"])
    assert "documents: FlexAttention block mask" in render(make_plan(cfg, nodes=8, gpu="a100"))
    cfg = load_config(PAPER_6_7B, ["data.reset_attention_mask=true", "data.eod_id=2",
                                   "model.backend=local", "parallel.recompute=full"])
    plan = make_plan(cfg, nodes=8, gpu="a100")
    assert any("data.reset_attention_mask" in w for w in plan.warnings)


# ------------------------------------------------------------------------- item 6: context parallel
@pytest.mark.parametrize("overrides, needle", [
    (["parallel.context=2", "model.backend=local"], "needs model.backend torch or te"),
    (["parallel.context=2", "train.seq_length=126"], "divisible by 2 x parallel.context (4)"),
    (["parallel.context=4", "train.seq_length=16", "model.attention=kv_shift",
      "model.kv_shift.window=3"], "exceeds a context-parallel chunk"),
    (["parallel.context=4", "model.num_attention_heads=8", "model.num_query_groups=2",
      "parallel.cp_comm_type=a2a"], "parallel.cp_comm_type a2a"),
    (["parallel.context=2", "model.mla.kv_lora_rank=64", "model.num_query_groups=null"],
     "with model.mla"),
])
def test_context_parallel_misconfigurations_in_one_line(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    message = str(e.value)
    assert needle in message and "\n" not in message, message


def test_context_parallel_documents_on_te_refused():
    """THD-packed documents are not split per CP rank: te + documents + CP stops
    in one line at start and in the plan (which assumes te for auto)."""
    from kvtrain.config.backend import check_document_masks

    cfg = load_config(None, ["parallel.context=2", "data.reset_attention_mask=true",
                             "data.eod_id=2"])
    with pytest.raises(ConfigError, match="needs model.backend torch") as e:
        check_document_masks(cfg, choice("te", False), half=True)
    assert "\n" not in str(e.value)
    check_document_masks(cfg, choice("torch", False), half=False)
    with pytest.raises(PlanError, match="parallel.context"):
        make_plan(load_config(PAPER_6_7B, ["parallel.context=2", "data.reset_attention_mask=true",
                                           "data.eod_id=2"]), nodes=8, gpu="a100")


@pytest.mark.parametrize("sets", [["data.reset_attention_mask=true", "data.eod_id=2"],
                                  ["parallel.context=2"]], ids=["documents", "cp"])
def test_te_in_fp32_refuses_what_only_its_16_bit_attention_does(monkeypatch, sets):
    """Transformer Engine's one fp32 attention is its unfused one, which takes neither
    THD-packed documents nor context parallelism (its flash and cuDNN kernels are
    16-bit only): TE would stop at the first forward ("No dot product attention
    backend is available"). te in fp32 with either stops in one line at start (the
    trainer's resolution, with a GPU and TE faked) and in the plan."""
    import torch

    from kvtrain.model import specs
    from kvtrain.model.builder import Numerics
    from kvtrain.train.setup import _resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(specs, "te_import_error", lambda: None)
    with pytest.raises(ConfigError, match="train.precision") as e:
        _resolve_backend(load_config(None, sets + ["model.backend=te"]), Numerics())
    assert "model.backend te" in str(e.value) and "\n" not in str(e.value), str(e.value)
    bf16 = Numerics(params_dtype=torch.bfloat16, bf16=True)
    assert _resolve_backend(load_config(None, sets + ["model.backend=te"]), bf16)[0].name == "te"
    assert _resolve_backend(load_config(None, sets + ["model.backend=torch"]), Numerics())[0] \
        .name == "torch"
    assert _resolve_backend(load_config(None, ["model.backend=te"]), Numerics())[0].name == "te"
    with pytest.raises(PlanError, match="train.precision"):
        make_plan(load_config(PAPER_6_7B, sets + ["train.precision=fp32"]), nodes=8, gpu="a100")


@pytest.mark.parametrize("sets", [["data.reset_attention_mask=true", "data.eod_id=2"],
                                  ["parallel.context=2"]], ids=["documents", "cp"])
def test_te_before_ampere_refuses_what_only_its_fused_attention_does(monkeypatch, sets):
    """Before compute capability 8.0 (V100: 7.0) Transformer Engine has neither flash
    nor cuDNN attention, and its unfused one takes neither THD-packed documents nor
    context parallelism: one line at start, naming the GPU's capability."""
    import torch

    from kvtrain.model import specs
    from kvtrain.model.builder import Numerics
    from kvtrain.train.setup import _resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    monkeypatch.setattr(specs, "te_import_error", lambda: None)
    fp16 = Numerics(params_dtype=torch.float16, fp16=True)
    with pytest.raises(ConfigError, match=r"compute capability 8.0 or newer \(this one: 7.0\)") as e:
        _resolve_backend(load_config(None, sets + ["model.backend=te"]), fp16)
    assert "model.backend torch" in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert _resolve_backend(load_config(None, ["model.backend=te"]), fp16)[0].name == "te"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert _resolve_backend(load_config(None, sets + ["model.backend=te"]), fp16)[0].name == "te"


def test_context_parallel_documents_record_the_kernel_that_runs(monkeypatch):
    """On a GPU the torch backend separates documents with FlexAttention, but under
    CP its attention over the gathered keys takes explicit masks (SDPA): the run's
    record says which (the trainer's resolution, with a GPU faked)."""
    import torch

    from kvtrain.model.builder import Numerics
    from kvtrain.train.setup import _resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    bf16 = Numerics(params_dtype=torch.bfloat16, bf16=True)
    sets = ["model.backend=torch", "data.reset_attention_mask=true", "data.eod_id=2"]
    assert _resolve_backend(load_config(None, sets), bf16)[0].documents == "flex"
    cp = load_config(None, sets + ["parallel.context=2"])
    assert _resolve_backend(cp, bf16)[0].documents == "sdpa+mask"


def test_context_parallel_records_the_communication_that_runs(monkeypatch):
    """parallel.cp_comm_type is Transformer Engine's: on torch the attention all-gathers
    K/V whatever it says, and the run's record says which ran (None without CP)."""
    import torch

    from kvtrain.model.builder import Numerics
    from kvtrain.train.setup import _resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    bf16 = Numerics(params_dtype=torch.bfloat16, bf16=True)
    sets = ["model.backend=torch", "parallel.context=2", "parallel.cp_comm_type=a2a"]
    torch_cp = _resolve_backend(load_config(None, sets), bf16)[0]
    assert torch_cp.context_parallel.startswith("all_gather of K/V (kvtrain")
    assert "parallel.cp_comm_type a2a applies to model.backend te" in torch_cp.context_parallel
    assert "; context parallel: all_gather" in torch_cp.describe()
    assert _resolve_backend(load_config(None, ["model.backend=torch"]), bf16)[0] \
        .context_parallel is None
    from kvtrain.config.backend import context_attention
    assert context_attention("te", "a2a") == "a2a (Transformer Engine)"
    assert context_attention("torch", "p2p").startswith("all_gather of K/V")
    # the plan says the same: te's ring by default (auto assumes te), torch's all-gather
    assert "context parallel: p2p (Transformer Engine)" in render(make_plan(
        load_config(PAPER_6_7B, ["parallel.context=2"]), nodes=8, gpu="a100"))
    assert "context parallel: all_gather of K/V" in render(make_plan(
        load_config(PAPER_6_7B, ["parallel.context=2", "model.backend=torch"]), nodes=8,
        gpu="a100"))


def test_plan_names_the_document_kernel_of_torch_cp_attention():
    """The plan says what the run will record: SDPA masks, not FlexAttention, under CP."""
    sets = ["data.reset_attention_mask=true", "data.eod_id=2", "model.backend=torch"]
    cfg = load_config(PAPER_6_7B, sets + ["parallel.context=2"])
    report = render(make_plan(cfg, nodes=8, gpu="a100"))
    assert "FlexAttention" not in report and "documents: SDPA" in report, report


def test_context_parallel_planned(capsys):
    from kvtrain.cli import main

    code = main(["plan", PAPER_6_7B, "--nodes", "8", "--set", "parallel.context=2"])
    out = capsys.readouterr().out
    assert code == 0 and "x CP 2 x DP" in out and "x CP 2)" in out, out


def test_plan_shards_optimizer_state_over_dp_times_cp():
    """megatron's distributed optimizer shards over DP x CP."""
    cfg = load_config(PAPER_6_7B)
    p, t = cfg.parallel, cfg.train
    cp = replace(p, context=2)
    one = estimate_memory(cfg.model, p, t, dp=4, num_microbatches=4)
    two = estimate_memory(cfg.model, cp, t, dp=4, num_microbatches=4)
    assert two.optimizer == pytest.approx(one.optimizer / 2)


def test_plan_counts_the_gathered_kv_of_torch_cp_attention():
    """The torch backend's CP attention keeps the all-gathered K and V of the whole
    sequence per layer ([S, b, 2 x kv_heads x head_dim / TP], bf16); te's does not."""
    cfg = load_config(PAPER_6_7B, ["parallel.context=2"])
    m, p, t = cfg.model, cfg.parallel, cfg.train
    gd = m.kv_heads * (m.hidden_size // m.num_attention_heads)
    args = (m, p, t.seq_length, t.micro_batch_size, "bf16")
    extra = layer_activation_bytes(*args, backend="torch") - layer_activation_bytes(*args)
    assert extra == pytest.approx(2 * t.seq_length * t.micro_batch_size * 2 * gd / p.tensor)


def _kept_by_one_layer(attention: str, groups: int, shift: list, backend: str,
                       fixed: bool = False) -> int:
    """Bytes autograd keeps for backward over one standard layer (see _kept_bytes)."""
    from kvtrain.config import ModelConfig

    return _kept_bytes(ModelConfig(
        num_layers=1, hidden_size=256, num_attention_heads=8, num_query_groups=groups,
        ffn_hidden_size=512, vocab_size=128, make_vocab_size_divisible_by=64,
        max_position_embeddings=64, attention=attention, kv_shift=_shift_config(shift, fixed),
        rope_kernel="torch"), backend)


def _shift_config(shift: list, fixed: bool):
    from kvtrain.config.model import ShiftHeadsConfig
    from kvtrain.config.schema import KVShiftConfig

    # fixed: every head of the shifted tensors takes the previous token (Appendix J)
    return KVShiftConfig(shift=shift, heads=ShiftHeadsConfig(fixed=True) if fixed else None)


def _kept_bytes(cfg, backend: str, seq: int = 64, batch: int = 2) -> int:
    """Bytes autograd keeps for backward over the first layer of ``cfg`` (fp32, RoPE,
    causal, no mask): the distinct storages saved, parameters excluded."""
    import torch

    from kvtrain.model.builder import build_gpt, transformer_config

    model = build_gpt(cfg, transformer_config(cfg), backend=backend)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()  # a saved output itself would keep its graph (and groups) alive

    # MLA computes its own RoPE (its layer takes no rotary_pos_emb)
    rope = {} if cfg.mla is not None else {"rotary_pos_emb": model.rotary_pos_emb(seq)}
    hidden = torch.randn(seq, batch, cfg.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.decoder.layers[0](hidden, attention_mask=None, **rope)
    return sum(kept.values())


@pytest.mark.parametrize("backend", ["torch", "local"])
@pytest.mark.parametrize("groups", [4, 8])
@pytest.mark.parametrize("shift", [["k", "v"], ["v"], ["k"], ["q", "k"], ["q", "k", "v"]])
@pytest.mark.parametrize("fixed", [False, True])
def test_plan_counts_what_the_shift_keeps(mp1, groups, shift, backend, fixed):
    """The plan's KV shift - vanilla difference per layer equals what autograd keeps,
    on both backends the CPU runs: the paper's K+V shift (one node in the QKV
    output) keeps the raw K/V and lets the QKV output go; the per-tensor variants
    keep it through their views, and a shifted GQA query as a copy; with fixed
    coefficients none of them keeps its input."""
    from kvtrain.config import ModelConfig
    from kvtrain.config.schema import ParallelConfig

    measured = (_kept_by_one_layer("kv_shift", groups, shift, backend, fixed)
                - _kept_by_one_layer("vanilla", groups, shift, backend))
    planned = [layer_activation_bytes(
        ModelConfig(num_layers=1, hidden_size=256, num_attention_heads=8,
                    num_query_groups=groups, ffn_hidden_size=512, attention=attention,
                    kv_shift=_shift_config(shift, fixed), rope_kernel="torch"),
        ParallelConfig(), 64, 2, "fp32", backend=backend)
        for attention in ("kv_shift", "vanilla")]
    # (to the bytes of a shifted query's coefficients, repeated per query head)
    assert planned[0] - planned[1] == pytest.approx(measured, abs=256)


@pytest.mark.parametrize("backend", ["torch", "local"])
@pytest.mark.parametrize("groups", [8, 4])
@pytest.mark.parametrize("attention", ["vanilla", "kv_shift"])
def test_plan_counts_a_whole_layer(mp1, attention, groups, backend):
    """The plan's bytes for one whole layer are what autograd keeps, to the byte, once
    what only the CPU keeps is added: torch's composite RMSNorm also keeps x·rstd and
    rstd per norm (CUDA's fused kernel keeps rstd), megatron's unfused RoPE keeps
    its cos/sin tables (two per rotated tensor, [s, 1, 1, d] each; per position, not
    per token), and the local spec a [s, s] causal mask (bool)."""
    from kvtrain.config import ModelConfig
    from kvtrain.config.schema import ParallelConfig

    seq, batch, h, heads = 64, 2, 256, 8
    cfg = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=heads,
                      num_query_groups=groups, ffn_hidden_size=512, vocab_size=128,
                      make_vocab_size_divisible_by=64, max_position_embeddings=seq,
                      attention=attention, rope_kernel="torch")  # a CPU run's RoPE
    planned = layer_activation_bytes(cfg, ParallelConfig(), seq, batch, "fp32", backend=backend)
    cpu_only = (4 * seq * batch * 2 * (h + 1)  # 2 norms: x·rstd [s, b, h] and rstd [s, b, 1]
                + 4 * 4 * seq * (h // heads)   # RoPE: cos and sin for Q and for K
                + (seq * seq if backend == "local" else 0))  # the causal mask
    assert _kept_bytes(cfg, backend, seq, batch) == planned + cpu_only


@pytest.mark.parametrize("backend", ["torch", "local"])
@pytest.mark.parametrize("q_lora_rank", [None, 40])
@pytest.mark.parametrize("attention", ["vanilla", "kv_shift", "fixed"])
def test_plan_counts_what_mla_keeps(mp1, attention, q_lora_rank, backend):
    """The plan's MLA layer (latents, per-head Q, K, V and output, the shift's raw K
    and V) is what autograd keeps, measured against a standard layer of the same
    width, heads and FFN: what both keep outside attention cancels (the layer norms,
    SwiGLU, the local spec's causal mask; RoPE's per-position tables too, the RoPE
    width being the standard head width, 32). The CPU's RMSNorm is composite ops
    that also keep x·rstd and rstd (the plan counts a norm's input and output; CUDA's
    fused kernel keeps rstd besides): the latent norms' share is taken out. On torch
    V is as wide as Q and K: the CPU's flash kernel takes equal widths only (its
    math fallback keeps s x s probabilities); the GPU's keep Q, K, V, the output and
    the log-sum-exp either way."""
    from kvtrain.config import MLAConfig, ModelConfig
    from kvtrain.config.model import ShiftHeadsConfig
    from kvtrain.config.schema import KVShiftConfig, ParallelConfig

    seq, batch = 64, 2
    standard = ModelConfig(num_layers=1, hidden_size=256, num_attention_heads=8,
                           ffn_hidden_size=512, vocab_size=128, make_vocab_size_divisible_by=64,
                           max_position_embeddings=seq)
    latent = MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=48, qk_head_dim=16,
                       qk_pos_emb_head_dim=32, v_head_dim=48 if backend == "torch" else 24)
    # fixed: the paper's MLA config (Appendix J: K of head 0, V of head 1, fixed)
    shift = KVShiftConfig(heads=ShiftHeadsConfig(k=[0], v=[1], fixed=attention == "fixed"))
    mla = replace(standard, attention="vanilla" if attention == "vanilla" else "kv_shift",
                  mla=latent, kv_shift=shift)
    measured = _kept_bytes(mla, backend, seq, batch) - _kept_bytes(standard, backend, seq, batch)
    composite = 4 * seq * batch * sum(width + 1 for width in (48, q_lora_rank) if width)
    planned = [layer_activation_bytes(cfg, ParallelConfig(), seq, batch, "fp32", backend=backend)
               for cfg in (mla, standard)]
    # (to the bytes of the selected heads' coefficients, [n, 2] each)
    assert planned[0] - planned[1] == pytest.approx(measured - composite, abs=256)


# ----------------------------------------------------------------------------- item 11: plan memory
def test_local_memory_adds_exactly_the_score_matrices():
    """Per layer on one GPU, bf16, no dropout: the local spec keeps softmax's fp32
    output and the bf16 probabilities the A·V matmul saves, [b, a/t, s, s] each,
    and no flash log-sum-exp; plus one [b, a/t, s, s] bf16 score buffer per GPU
    (megatron's global memory buffer, reused by every layer)."""
    cfg = load_config(PAPER_6_7B, ["parallel.recompute=none",
                                   "model.cross_entropy_kernel=torch"])  # one loss on both
    m, p, t = cfg.model, cfg.parallel, cfg.train
    b, s, heads = t.micro_batch_size, t.seq_length, m.num_attention_heads // p.tensor
    scores = b * heads * s * s
    lse = 4 * heads * s * b

    def extra(model, precision):
        return (layer_activation_bytes(model, p, s, b, precision, backend="local")
                - layer_activation_bytes(model, p, s, b, precision, backend="te"))

    assert extra(m, "bf16") == scores * (4 + 2) - lse
    # dropout: a 1-byte mask, and the matmul saves the dropped copy
    assert extra(replace(m, attention_dropout=0.1), "bf16") == scores * (4 + 1 + 2) - lse
    # fp32: the matmul saves softmax's own output
    assert extra(m, "fp32") == scores * 4 - lse
    # a whole stage: layers x in-flight micro batches, plus the score buffer
    a_te = activation_bytes(m, p, s, b, 4, "none", precision="bf16", backend="te")
    a_local = activation_bytes(m, p, s, b, 4, "none", precision="bf16", backend="local")
    layers_in_flight = m.num_layers // p.pipeline * a_te["in_flight"]
    assert a_local["total"] - a_te["total"] == \
        layers_in_flight * (scores * 6 - lse) + 2 * scores
    # selective recompute (megatron's core-attention recompute) keeps no scores:
    # one layer's are rebuilt at a time in the backward pass
    sel = activation_bytes(m, p, s, b, 4, "selective", precision="bf16", backend="local")
    assert sel["total"] == a_te["total"] - layers_in_flight * lse + scores * 6 + 2 * scores


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_local_score_bytes_are_what_autograd_saves(mp1, precision):
    """The per-element bytes of the plan's local-spec term, measured: what megatron's
    local DotProductAttention hands autograd in tensors of [.., s, s] (no dropout;
    dropout's mask differs between the CPU and CUDA's fused kernel)."""
    import torch

    from kvtrain.config import ModelConfig
    from kvtrain.model.builder import Numerics, build_gpt, transformer_config
    from kvtrain.plan.memory import score_bytes_kept

    s, b, heads = 32, 2, 4
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, vocab_size=128,
                      make_vocab_size_divisible_by=64, max_position_embeddings=s)
    numerics = Numerics.from_precision(precision)
    model = build_gpt(cfg, transformer_config(cfg, numerics=numerics), backend="local")
    core = model.decoder.layers[0].self_attention.core_attention
    saved = {}

    def pack(t):
        if t.dim() >= 2 and t.shape[-2:] == (s, s) and t.numel() >= b * heads * s * s:
            saved[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t.detach()  # a saved output itself would keep its graph (and groups) alive

    q, k, v = (torch.randn(s, b, heads, 16, dtype=numerics.params_dtype, requires_grad=True)
               for _ in range(3))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        core(q, k, v, None)
    assert sum(saved.values()) / (b * heads * s * s) == score_bytes_kept(cfg, precision)


def test_plan_memory_follows_the_backend_and_says_which():
    sel = ["parallel.recompute=selective"]
    auto = make_plan(load_config(PAPER_6_7B, sel), nodes=8, gpu="a100")
    local = make_plan(load_config(PAPER_6_7B, sel + ["model.backend=local"]), nodes=8, gpu="a100")
    assert local.memory.activations > auto.memory.activations
    # without recompute the local spec's scores do not fit where flash attention does
    with pytest.raises(PlanError, match="exceeds the 80 GiB"):
        make_plan(load_config(PAPER_6_7B, ["model.backend=local"]), nodes=8, gpu="a100")
    assert auto.memory.attention == "te" and local.memory.attention == "local"
    assert "attention memory: te spec assumed (model.backend auto" in render(auto)
    assert "attention memory: local spec (model.backend local): s x s scores" in render(local)
    # torch keeps what flash attention keeps, like te, and both take the fused loss:
    # the bf16 logits alone (2 bytes each; megatron's loss, on local, 6)
    torch_plan = make_plan(load_config(PAPER_6_7B, sel + ["model.backend=torch"]), nodes=8,
                           gpu="a100")
    assert torch_plan.memory.attention == "torch"
    assert auto.memory.logits > 0 and torch_plan.memory.logits == auto.memory.logits
    assert local.memory.logits == 3 * auto.memory.logits
    # and RoPE's cos/sin table where kvtrain's Triton RoPE runs (fp32 [s, 2r] per chunk)
    m, t = torch_plan.cfg.model, torch_plan.cfg.train
    table = 4 * t.seq_length * 2 * (m.hidden_size // m.num_attention_heads)
    assert torch_plan.memory.activations == auto.memory.activations + table
    assert "attention memory: torch spec (model.backend torch): SDPA flash kernels, no s x s " \
        "scores" in render(torch_plan)


# ----------------------------------------------------------------------------- what a user sees
def test_train_prints_and_records_the_backend_and_refuses_a_lost_gpu(tmp_path, cache_dir):
    import dataclasses

    import torch

    from kvtrain.model.cross_entropy import choose_cross_entropy
    from kvtrain.model.rope import choose_rope
    from kvtrain.model.shift_kernels import choose_kernel
    from kvtrain.model.specs import backend_choice
    from kvtrain.model.swiglu import choose_swiglu
    from kvtrain.train import multi_tensor
    from kvtrain.train.flops import mfu_peak
    from kvtrain.train.optimizer import adam_kernel, megatron_adam_class

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    kernel, why = choose_kernel("auto", cuda, torch.bfloat16 if cuda else torch.float32)
    backend = backend_choice("auto")
    rope_kernel, rope_why = choose_rope("auto", backend.name, cuda, mla=False)
    if rope_kernel == "triton" and backend.name == "torch":  # the layers fuse it with the split
        rope_kernel = "triton in the QKV split"
    rope = f"{rope_kernel} ({rope_why})"
    loss = "{} ({})".format(*choose_cross_entropy("auto", backend.name, cuda))
    swiglu = "{} ({})".format(*choose_swiglu("auto", backend.name, cuda,
                                             torch.bfloat16 if cuda else torch.float32))
    expected = dataclasses.replace(backend, shift_kernel=f"{kernel} ({why})", rope=rope,
                                   cross_entropy=loss, swiglu=swiglu,
                                   multi_tensor=multi_tensor.install(),
                                   optimizer=adam_kernel(megatron_adam_class()))
    cfg = tiny_config(None, cache_dir, train={"max_steps": 2}, checkpoint={"save_interval": 2})
    assert cfg["model"]["attention"] == "kv_shift"
    path = write_config(tmp_path / "cfg.yaml", cfg)
    ok = run(["train", str(path), "--run-dir", str(tmp_path / "run")])
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert f"kvtrain: {expected.describe()}, device {device}" in ok.stdout
    if device == "cpu":
        assert ("kvtrain: backend torch (auto: no GPU; fused softmax: no; "
                "KV shift: native (auto: CPU); RoPE: torch (auto: no GPU); "
                "cross-entropy: torch (auto: no GPU); SwiGLU: torch (auto: no GPU); "
                "multi-tensor ops: torch foreach (kvtrain); "
                "optimizer: torch fused AdamW (kvtrain)), device cpu") in ok.stdout
    # what MFU is measured against is said too: on the CPU, none and why
    mfu = "none: no GPU (set train.peak_tflops_per_device for MFU)" if device == "cpu" else \
        mfu_peak(None, "bf16")[1]
    assert f"kvtrain: MFU against {mfu}" in ok.stdout
    events = [r for r in metrics(tmp_path / "run", kind="event") if "backend" in r]
    assert [(e["iteration"], e["backend"], e["device"], e["mfu"]) for e in events] == \
        [(0, expected.as_dict(), device, mfu)]
    saved = tmp_path / "run" / "config.yaml"
    assert f"# backend: {expected.name} ({expected.reason}" in saved.read_text()
    assert (f"; KV shift: {expected.shift_kernel}; RoPE: {rope}; cross-entropy: {loss}; "
            f"SwiGLU: {swiglu}; multi-tensor ops: "
            f"{expected.multi_tensor}; optimizer: {expected.optimizer})\n") in saved.read_text()
    assert load_config(saved).model.backend == "auto"  # still a config kvtrain train reads
    assert yaml.safe_load(saved.read_text())["model"]["backend"] == "auto"
    (common,) = (tmp_path / "run" / "checkpoints").glob("*/common.pt")
    resolved = torch.load(common, weights_only=False)["kvtrain"]["config"]["resolved"]
    precision = "fp32" if device == "cpu" else "bf16"  # train.precision auto
    assert resolved == {"backend": expected.as_dict(), "device": device, "precision": precision,
                        "mfu": mfu}
    assert f"device {device}, precision {precision}; MFU against {mfu}\n" in saved.read_text()

    # a job given a GPU that torch cannot see (on a GPU machine: hidden from torch)
    lost_gpu = {"CUDA_VISIBLE_DEVICES": "0"} if device == "cpu" else \
        {"CUDA_VISIBLE_DEVICES": "-1", "SLURM_JOB_GPUS": "0"}
    lost = run(["train", str(path), "--run-dir", str(tmp_path / "lost")], env=lost_gpu)
    assert lost.returncode == 2, lost.stdout[-3000:]
    line = one_line_error(lost)
    assert "the launcher gave this process GPUs" in line and "torch sees no GPU" in line
    assert list(lost_gpu.items())[-1][0] in line
    assert not (tmp_path / "lost" / "checkpoints").exists()


def test_the_calibration_point_in_the_memory_docstring_is_current():
    """kvtrain/plan/memory.py quotes its estimate of the paper's BlaGPT-scale model
    (Table 13: 4096 tokens x 16 sequences on one A100) beside the paper's measured
    peak: the quoted estimates are what the plan gives today."""
    import re

    import kvtrain.plan.memory as memory

    text = " ".join(memory.__doc__.split())
    quoted = re.search(r"estimates ([\d,]+) MiB \(te; [^)]*\), ([\d,]+) MiB with KV shifting", text)
    assert quoted, "the calibration sentence moved: update this test with it"
    sets = ["train.seq_length=4096", "model.max_position_embeddings=4096",
            "train.micro_batch_size=16", "train.global_batch_size=16",
            "model.cross_entropy_kernel=torch"]  # megatron's loss, as the paper ran
    for arm, mib in zip(("vanilla", "kv_shift"), quoted.groups()):
        cfg = load_config(f"configs/blagpt/{arm}.yaml", sets)
        plan = make_plan(cfg, nodes=1, gpus_per_node=1, gpu="a100")
        assert round(plan.memory.total / 2**20) == int(mib.replace(",", "")), arm


@pytest.mark.parametrize("hidden, kernel", [(32, "sdpa+mask"), (64, "flex")])
def test_documents_take_flex_attention_only_at_a_head_dim_it_compiles(monkeypatch, hidden, kernel):
    """FlexAttention's GPU kernels need heads of >= 16 channels (Triton's tl.dot;
    inductor raises NotImplementedError below): narrower heads separate documents
    with SDPA masks, and the record says so (4 heads: 8 and 16 channels)."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from kvtrain.model.attention import TorchAttention
    from kvtrain.model.builder import Numerics, transformer_config
    from kvtrain.train.setup import _resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    bf16 = Numerics(params_dtype=torch.bfloat16, bf16=True)
    cfg = load_config(None, ["model.backend=torch", "data.reset_attention_mask=true",
                             "data.eod_id=2", "model.num_attention_heads=4",
                             f"model.hidden_size={hidden}"])
    assert _resolve_backend(cfg, bf16)[0].documents == kernel
    attention = TorchAttention(transformer_config(cfg.model, cfg.parallel), 1,
                               AttnMaskType.causal, "self")
    assert attention.documents_kernel == kernel
