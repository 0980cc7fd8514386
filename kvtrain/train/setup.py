"""Everything a run needs, built once: process groups, the model chunks wrapped
in megatron's DDP, the (distributed) optimizer and schedule, the data, the
checkpointer and the loggers.

The parallel layout comes from the config: TP and PP (with optional virtual
stages) from ``parallel``, DP from the world size, sequence parallelism and the
distributed optimizer from their switches. The device (``train.device``) and the
backend (``model.backend``) are resolved here, once per start; ``Run.resolved``
is what they became, printed and recorded by the trainer.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from kvtrain.config import ConfigError, RunConfig, checkpoint_folder, run_folder, to_dict
from kvtrain.config.backend import BackendChoice
from kvtrain.config.layout import Layout, derive_layout
from kvtrain.output import write_whole

from .flops import mfu_peak, training_flops_per_step

if TYPE_CHECKING:
    from kvtrain.backend import DistEnv

    from .checkpoint import TrainState


def resolve_run_dir(cfg: RunConfig, override: Optional[str] = None) -> Path:
    """``--run-dir``, else ``run_dir`` from the config, else ``runs/<name>``."""
    return run_folder(cfg, override)


@dataclass
class Run:
    """The built pieces of a run on this rank."""

    cfg: RunConfig
    run_dir: Path
    rank: int
    world_size: int
    dp_rank: int
    layout: Layout  # DP size, micro batches, steps, padded vocabulary (config/layout.py)
    model: list  # DDP-wrapped chunks (one per virtual pipeline stage)
    optimizer: Any
    scheduler: Any
    forward_backward: Any
    flops_per_step: float
    peak_tflops: Optional[float]  # MFU's denominator (None: no MFU)
    mfu_basis: str  # what peak_tflops is, or why there is none (flops.mfu_peak)
    checkpoint_dir: Path
    backend: BackendChoice
    device: str  # "cuda" | "cpu"
    precision: str = "fp32"  # train.precision as resolved (Numerics.precision)
    datasets: Any = None  # train/valid/test and the tokenizer (build_data)
    documents: Optional[Callable] = None  # model.documents.Documents, with reset_attention_mask

    @property
    def dp_size(self) -> int:
        return self.layout.data_parallel

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches

    @property
    def total_steps(self) -> int:
        return self.layout.total_steps

    @property
    def resolved(self) -> dict:
        """What this start's ``auto`` settings became (plain data, for every record)."""
        return {"backend": self.backend.as_dict(), "device": self.device,
                "precision": self.precision, "mfu": self.mfu_basis}


def run_record(cfg: RunConfig, resolved: dict) -> dict:
    """The config saved with checkpoints and given to wandb: ``to_dict(cfg)`` plus
    a ``resolved`` section (not a config key: drop it before ``from_dict``)."""
    return {**to_dict(cfg), "resolved": resolved}


def backend_event(run: Run, iteration: int) -> dict:
    """The metrics.jsonl record of the resolved backend and device (one per start)."""
    return {"kind": "event", "iteration": iteration,
            "message": f"{run.backend.describe()}, device {run.device}, precision "
                       f"{run.precision}; MFU against {run.mfu_basis}",
            **run.resolved}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernels a run resolved once at its start (recorded on its ``BackendChoice``)."""

    shift: Optional[str] = None
    """The KV shift's (``native``, ``triton``, ``torch``); None for vanilla attention."""
    rope_fusion: bool = False
    """RoPE takes megatron's fused slot (kvtrain's Triton kernel or TE's)."""
    cross_entropy: str = "torch"
    """The loss's: ``triton`` (kvtrain's fused one) or ``torch`` (megatron's)."""
    swiglu: str = "torch"
    """The MLP activation's: ``triton`` (kvtrain's kernel) or ``torch`` (torch's ops)."""


def _build_model(cfg: RunConfig, tconfig, numerics, backend: str,
                 kernels: Kernels = Kernels()) -> list:
    """GPTModel chunks of this rank (one per virtual stage), wrapped for mixed
    precision and in megatron's DistributedDataParallel."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from kvtrain.backend.distributed import register_ddp
    from kvtrain.model.builder import build_gpt
    from kvtrain.model.coefficient_grads import untrack_coefficients

    p = cfg.parallel
    chunks = []
    for vp_stage in range(p.virtual_pipeline or 1):
        chunk = build_gpt(cfg.model, tconfig, seed=cfg.train.seed, backend=backend,
                          vp_stage=vp_stage if p.virtual_pipeline else None,
                          shift_kernel=kernels.shift, cross_entropy=kernels.cross_entropy,
                          swiglu=kernels.swiglu)
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if numerics.bf16 or numerics.fp16:
            chunk = Float16Module(tconfig, chunk)
        chunks.append(chunk)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # bf16 grads accumulate and reduce in fp32
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.distributed_optimizer,
        check_for_nan_in_grad=False,  # non-finite steps are handled by the trainer
    )
    model = [
        DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk,
                                # only the first chunk's buckets overlap with backward
                                disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    for chunk in model:
        register_ddp(chunk)  # see release_models
        chunk.broadcast_params()  # identical replicas whatever each rank's init did
        untrack_coefficients(chunk)  # their gradients straight into main_grad, if they may
    return model


def _check_this_machine(cfg: RunConfig, numerics) -> None:
    """What only the machine that trains can check (plan and submit run elsewhere)."""
    if numerics.fp16 and not torch.cuda.is_available():
        raise ConfigError("train.precision fp16 needs a GPU (use fp32 or auto on CPU)")
    cpus = len(os.sched_getaffinity(0))
    if cfg.data.num_workers > cpus:  # more never helps; a slip (100000) exhausts the node
        raise ConfigError(f"data.num_workers ({cfg.data.num_workers}) exceeds the {cpus} CPUs "
                          "this rank may use: DataLoader workers per rank, each a process")


def _schedule_settings(tconfig, p) -> None:
    """What megatron's schedule reads from ``tconfig`` for a training step of layout ``p``."""
    from megatron.core.distributed import finalize_model_grads

    # gradients are divided by the token count of the global batch in
    # finalize_model_grads, not by DP size
    tconfig.calculate_per_token_loss = True
    # without it data-parallel gradients are never all-reduced (megatron's DDP hooks
    # only accumulate when overlap is off)
    tconfig.finalize_model_grads_func = finalize_model_grads
    if p.virtual_pipeline:
        # As Megatron-LM: in the interleaved 1F1B steady state a rank exchanges
        # activations and gradients with both neighbours at once, and with two stages
        # they are one peer; megatron-core's default batched p2p cannot tell the two
        # directions apart (Megatron-LM issue #750), so micro batches got another's
        # gradient as activations. The overlapped p2p sends each direction separately.
        tconfig.overlap_p2p_comm, tconfig.batch_p2p_comm = True, False


def build_run(cfg: RunConfig, run_dir: Path, env: Optional[DistEnv] = None,
              data: bool = True) -> Run:
    """Builds the run on this rank (collective: every rank calls it).

    ``env``: the process group and megatron's parallel state are already set up
    for this config's layout (``init_distributed``), so they are not rebuilt: a
    second run in the same process (``benchmarks/step.py`` builds two) must not
    replace megatron's global groups under the first one's model and optimizer.
    ``data``: build the datasets for a fresh run (False: the caller builds them
    with ``build_data`` once the start is known, as ``train()`` does after the
    resume, so that they are built once).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from kvtrain.backend import init_model_parallel, init_process_group, set_seed
    from kvtrain.model.builder import Numerics, transformer_config

    from . import multi_tensor
    from .optimizer import build_optimizer, build_scheduler

    p, t = cfg.parallel, cfg.train
    if env is None:
        # the config's checks before megatron's groups, whose refusals are RuntimeErrors
        env = init_process_group(t.dist_timeout_minutes, t.device)
        cfg.validate(world_size=env.world_size)
        init_model_parallel(p.tensor, p.pipeline, p.virtual_pipeline, p.context,
                            t.dist_timeout_minutes)
        set_seed(t.seed)
    else:
        cfg.validate(world_size=env.world_size)
    numerics = Numerics.from_precision(t.precision)
    _check_this_machine(cfg, numerics)
    backend, kernels = _resolve_backend(cfg, numerics)  # once per run
    tconfig = transformer_config(cfg.model, p, numerics, rope_fusion=kernels.rope_fusion)
    _schedule_settings(tconfig, p)  # before DDP is built (DDP reads them)
    model = _build_model(cfg, tconfig, numerics, backend.name, kernels)
    if p.overlap_grad_reduce:
        # as Megatron-LM: no grad sync inside the micro-batch loop, and with PP the
        # stages launch their reduce-scatters in step (its align_grad_reduce default)
        no_sync = [m.no_sync for m in model]
        tconfig.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if p.pipeline > 1:
            grad_sync = [m.start_grad_sync for m in model]
            tconfig.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync

    layout = derive_layout(cfg, env.world_size)
    megatron_dp = parallel_state.get_data_parallel_world_size()
    if layout.data_parallel != megatron_dp:  # one rule: megatron's groups must agree with it
        raise RuntimeError(f"megatron's data-parallel size {megatron_dp} differs from the "
                           f"layout's {layout.data_parallel}")
    steps = layout.total_steps
    # megatron's fallback without TE/apex syncs the host per gradient tensor and
    # updates on torch's foreach AdamW: kvtrain's foreach ops, torch's fused AdamW
    multi = multi_tensor.install()
    optimizer, update = build_optimizer(cfg, numerics, model)
    backend = dataclasses.replace(backend, multi_tensor=multi, optimizer=update)
    tconfig.grad_scale_func = optimizer.scale_loss  # fp16 loss scaling (1.0 otherwise)
    scheduler = build_scheduler(cfg, optimizer, steps)

    dp_rank = parallel_state.get_data_parallel_rank()
    peak, mfu_basis = mfu_peak(t.peak_tflops_per_device, numerics.precision)

    run = Run(
        cfg=cfg, run_dir=run_dir, rank=env.rank, world_size=env.world_size,
        dp_rank=dp_rank, layout=layout, model=model, optimizer=optimizer, scheduler=scheduler,
        forward_backward=get_forward_backward_func(),
        flops_per_step=training_flops_per_step(cfg.model, t.seq_length, t.global_batch_size,
                                               layout.padded_vocab_size),
        peak_tflops=peak,
        mfu_basis=mfu_basis,
        checkpoint_dir=checkpoint_folder(cfg.checkpoint.dir, run_dir),
        backend=backend, device="cuda" if torch.cuda.is_available() else "cpu",
        precision=numerics.precision,
    )
    if data:
        build_data(run)
    return run


def build_data(run: Run, state: Optional["TrainState"] = None) -> None:
    """The run's datasets, and how its layers keep documents apart, once the start
    is known: the training part is built for the samples this start draws - the
    checkpoint's, then the steps left at this global batch (``fit_token_budget``
    has moved the end) - which differ from a fresh run's after a change of
    ``train.global_batch_size`` or ``train.seq_length`` (a smaller batch draws
    more, past the data's end). Sized exactly, so that a later resume with the
    same batch builds the same data (megatron's order depends on the count)."""
    from kvtrain.data import build_datasets

    t = run.cfg.train
    consumed, iteration = (state.consumed_samples, state.iteration) if state else (0, 0)
    needed = consumed + max(run.total_steps - iteration, 0) * t.global_batch_size
    cache_dir = str(Path(run.cfg.data.cache_dir).expanduser() if run.cfg.data.cache_dir
                    else run.run_dir / "data_cache")
    valid_samples = t.eval_iters * t.global_batch_size if t.eval_interval else 0
    run.datasets = build_datasets(run.cfg, cache_dir, needed, valid_samples)
    if run.rank == 0:
        for line in run.datasets.warnings:
            print(line, flush=True)
    run.documents = _documents(run.cfg, run.datasets, run.backend.name)


def fit_token_budget(run: Run, state: "TrainState") -> Optional[str]:
    """A resumed run sized by ``train.train_tokens`` ends where its consumed tokens
    (``state.consumed_tokens``, counted) reach the budget: after a change of
    ``train.global_batch_size`` or ``train.seq_length`` (allowed by
    ``checkpoint.allow_config_changes``) the checkpoint's steps were of another
    size, so the steps left and the LR schedule's end move (what it says, or None)."""
    from kvtrain.config.layout import total_steps

    from .optimizer import set_horizon

    iteration = state.iteration
    steps, steps_from = total_steps(run.cfg, iteration, state.consumed_tokens)
    if steps == run.total_steps:
        return None
    t, o = run.cfg.train, run.cfg.optimizer
    left = (f"{steps_from} after the checkpoint's {state.consumed_tokens} tokens: "
            f"{steps - iteration} steps of {t.global_batch_size} x {t.seq_length} left")
    # config validation saw a fresh run's end, not this one
    o.check_wsd_fits(o.lr_decay_steps or steps, f", its end moved by this resume ({left}): "
                     "lower it, or fix the schedule's length with optimizer.lr_decay_steps")
    before = run.total_steps
    run.layout = dataclasses.replace(run.layout, total_steps=steps, steps_from=steps_from)
    set_horizon(run.scheduler, run.cfg, steps)
    return f"{left}, the run and its LR schedule end at step {steps} (not {before})"


def _resolve_backend(cfg: RunConfig, numerics) -> tuple[BackendChoice, Kernels]:
    """The run's backend on this machine, with how it keeps documents apart and what
    computes the KV shift, RoPE and the loss (refusing what it cannot do); and those
    kernels, for the model's builder."""
    from kvtrain.config.backend import (check_document_masks, check_te_mla,
                                        check_te_precision, context_attention,
                                        document_attention)
    from kvtrain.model import rope
    from kvtrain.model.cross_entropy import choose_cross_entropy
    from kvtrain.model.shift_kernels import choose_kernel
    from kvtrain.model.specs import backend_choice
    from kvtrain.model.swiglu import choose_swiglu

    cuda = torch.cuda.is_available()
    backend = backend_choice(cfg.model.backend)
    check_document_masks(cfg, backend, half=numerics.bf16 or numerics.fp16)
    check_te_mla(cfg, backend)
    # the GPU's capability matters to te's documents and CP only (asked only then)
    asks = cuda and backend.name == "te" and (cfg.data.reset_attention_mask
                                              or cfg.parallel.context > 1)
    check_te_precision(cfg, backend, half=numerics.bf16 or numerics.fp16,
                       capability=torch.cuda.get_device_capability() if asks else None)
    if cfg.data.reset_attention_mask:
        backend = dataclasses.replace(backend, documents=document_attention(
            backend.name, cuda, cfg.model.attention_dropout, cfg.parallel.context,
            cfg.model.head_dim))
    if cfg.parallel.context > 1:
        backend = dataclasses.replace(backend, context_parallel=context_attention(
            backend.name, cfg.parallel.cp_comm_type))
    shift = None
    if cfg.model.attention == "kv_shift":
        shift, shift_why = choose_kernel(cfg.model.kv_shift.kernel, cuda, numerics.params_dtype)
        backend = dataclasses.replace(backend, shift_kernel=f"{shift} ({shift_why})")
    in_split = _rope_in_the_split(cfg, backend.name, shift)
    rope_kernel, why = rope.resolve(cfg.model, backend.name, cuda, cfg.model.rope_kernel,
                                    in_split=in_split)
    fused = rope.fuses(rope_kernel)
    if rope_kernel == "triton" and in_split:
        rope_kernel = "triton in the QKV split"  # kvtrain.model.rope_attention
    loss, loss_why = choose_cross_entropy(cfg.model.cross_entropy_kernel, backend.name, cuda)
    swiglu, swiglu_why = choose_swiglu(cfg.model.swiglu_kernel, backend.name, cuda,
                                       numerics.params_dtype)
    backend = dataclasses.replace(backend, rope=f"{rope_kernel} ({why})",
                                  cross_entropy=f"{loss} ({loss_why})",
                                  swiglu=f"{swiglu} ({swiglu_why})")
    return backend, Kernels(shift, fused, loss, swiglu)


def _rope_in_the_split(cfg: RunConfig, backend: str, shift: Optional[str]) -> bool:
    """Whether the layers take kvtrain's Triton RoPE inside their QKV split
    (``FusedRoPESelfAttention``): the torch backend without context parallelism,
    vanilla or the paper's K+V shift on the Triton kernels."""
    if backend != "torch" or cfg.parallel.context > 1:
        return False
    return shift is None or (shift == "triton" and sorted(cfg.model.kv_shift.shift) == ["k", "v"])


def _documents(cfg: RunConfig, datasets, backend: str) -> Optional[Callable]:
    """What the forward step needs to separate documents (None: not asked for)."""
    if not cfg.data.reset_attention_mask:
        return None
    from kvtrain.model.documents import Documents

    return Documents(eod=int(datasets.tokenizer.eod), thd=backend == "te")


def run_config_text(cfg: RunConfig, resolved: Optional[dict] = None) -> str:
    """The resolved config as YAML (block style, one key a line: it is read by
    people as much as by programs). ``resolved`` (``Run.resolved``) goes in as a
    comment header, so the text still loads as a config; programs read it from
    metrics.jsonl's event."""
    import yaml

    text = yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
    if resolved:
        backend = BackendChoice(**resolved["backend"])
        mfu = f"; MFU against {resolved['mfu']}" if resolved.get("mfu") else ""
        precision = f", precision {resolved['precision']}" if resolved.get("precision") else ""
        text = (f"# resolved at the last start: device {resolved['device']}{precision}{mfu}\n"
                f"# backend: {backend.name} ({backend.details()})\n{text}")
    return text


def write_run_config(text: str, run_dir: Path) -> None:
    """Saves ``text`` (:func:`run_config_text`) as ``<run_dir>/config.yaml``, whole
    (a full disk: one line, ``OutputError``, and the file of an earlier start kept)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_whole(run_dir / "config.yaml", text)


__all__ = ["Run", "backend_event", "build_data", "build_run", "fit_token_budget",
           "resolve_run_dir", "run_config_text", "run_record", "write_run_config"]
