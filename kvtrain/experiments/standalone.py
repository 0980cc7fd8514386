"""A small single-process training loop for the toy experiments.

It builds megatron's ``GPTModel`` with kvtrain's ``build_gpt`` (the same model
``kvtrain train`` trains: Llama-style, vanilla or KV-shift attention) and
trains it with ``torch.optim.AdamW`` on one CPU or GPU - no megatron
optimizer, no DDP, no checkpoints. Every evaluation runs the model over the
fixed evaluation set and records the masked accuracies (first / all
prediction positions) and the mean LM loss.

Same seed, same data for every arm: the weights are initialised after
``set_seed(seed)`` (arms of equal shape start from the same weights; KV-shift
arms differ only by their shift coefficients), training batch ``k`` is samples
``k*B .. (k+1)*B-1`` of the training set, and the evaluation set is fixed.
"""

from __future__ import annotations

import csv
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

CURVE_FIELDS = ["arm", "step", "accuracy", "accuracy_all", "loss", "train_loss", "lr",
                "elapsed_s"]


@dataclass(frozen=True)
class Arm:
    """One model of a grid."""

    name: str
    attention: str  # vanilla | kv_shift
    num_layers: int


@dataclass(frozen=True)
class Settings:
    """Everything an experiment fixes for all its arms."""

    task: str  # induction | ngram
    task_options: tuple  # ((key, value), ...) for kvtrain.data.induction.build_task
    seq_length: int
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int]
    lr: float
    warmup_steps: int
    batch_size: int
    micro_batch_size: int
    steps: int
    eval_interval: int
    eval_samples: int
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_betas: tuple = (0.9, 0.95)
    adam_eps: float = 1e-8
    rotary_base: int = 100000
    init_method_std: float = 0.02
    seed: int = 1234
    data_seed: int = 0
    eval_seed: int = 1_000_003

    def replace(self, **changes) -> "Settings":
        values = asdict(self)
        values.update(changes)
        values["task_options"] = tuple(values["task_options"])
        values["adam_betas"] = tuple(values["adam_betas"])
        return Settings(**values)


def model_config(s: Settings, arm: Arm):
    from kvtrain.config import ModelConfig

    return ModelConfig(
        num_layers=arm.num_layers, hidden_size=s.hidden_size,
        num_attention_heads=s.num_attention_heads, ffn_hidden_size=s.ffn_hidden_size,
        vocab_size=s.vocab_size, max_position_embeddings=s.seq_length,
        rotary_base=s.rotary_base, attention=arm.attention, init_method_std=s.init_method_std,
    )


def datasets(s: Settings):
    from kvtrain.data.induction import build_task, train_and_eval

    task = build_task(s.task, s.seq_length, **dict(s.task_options))
    if task.vocab_size > s.vocab_size:
        raise ValueError(f"the task needs a vocabulary of {task.vocab_size} ids, "
                         f"the model has {s.vocab_size}")
    return train_and_eval(task, s.steps * s.batch_size, s.eval_samples, s.data_seed, s.eval_seed)


def _lr_at(s: Settings, step: int) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then constant (the paper's schedule)."""
    if s.warmup_steps and step <= s.warmup_steps:
        return s.lr * step / s.warmup_steps
    return s.lr


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # No decay on norms, biases and the KV-shift coefficients (as the trainer).
        (no_decay if p.dim() < 2 or getattr(p, "kv_shift", False) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def evaluate(model, eval_batches, mask_names: tuple[str, str], vocab_size: int) -> dict:
    """Accuracy at the primary and "all" masks and the mean LM loss over the eval set."""
    import torch

    from .metrics import masked_correct

    model.eval()
    correct = [0, 0]
    total = [0, 0]
    loss_sum = loss_n = 0.0
    with torch.no_grad():
        for batch in eval_batches:
            logits = model(batch["tokens"], batch["position_ids"], None)  # [b, s, V]
            logits = logits[..., :vocab_size].float()
            for i, name in enumerate(mask_names):
                c, n = masked_correct(logits, batch["labels"], batch[name])
                correct[i] += c
                total[i] += n
            ce = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
            m = batch["loss_mask"].flatten()
            loss_sum += float((ce * m).sum())
            loss_n += float(m.sum())
    model.train()
    acc = [c / n if n else float("nan") for c, n in zip(correct, total)]
    return {"accuracy": acc[0], "accuracy_all": acc[1], "loss": loss_sum / max(loss_n, 1.0)}


def train_arm(s: Settings, arm: Arm, out_dir: Optional[str | Path] = None, threads: int = 0,
              on_eval: Optional[Callable[[dict], None]] = None, log: Callable = print) -> dict:
    """Trains one arm; returns ``{"arm", "rows", "wall_s", "params"}``.

    ``rows`` has one dict per evaluation (step 0 included) with the
    ``CURVE_FIELDS``; with ``out_dir`` they are also appended to
    ``out_dir/curve.csv`` as they come (a killed run keeps its curve).
    """
    import torch

    from kvtrain.backend import init_distributed, set_seed
    from kvtrain.model.builder import build_gpt, count_parameters, transformer_config

    from .metrics import MASKS

    if threads:
        torch.set_num_threads(threads)
    t0 = time.time()
    import torch.distributed as dist

    from megatron.core import parallel_state

    if not dist.is_initialized():
        init_distributed(seed=s.seed)
    elif not parallel_state.model_parallel_is_initialized():
        from kvtrain.backend import init_model_parallel

        init_model_parallel(1, 1)
    set_seed(s.seed)
    device = _device()
    cfg = model_config(s, arm)
    cfg.validate()
    model = build_gpt(cfg, transformer_config(cfg), seed=s.seed).to(device)
    params = count_parameters(model)
    opt = torch.optim.AdamW(_param_groups(model, s.weight_decay), lr=s.lr, betas=s.adam_betas,
                            eps=s.adam_eps)
    train_ds, eval_ds = datasets(s)
    mask_names = MASKS[s.task]
    keys = ("tokens", "labels", "loss_mask", "position_ids") + mask_names

    def to_dev(batch):
        return {k: batch[k].to(device) for k in keys}

    eval_batches = [to_dev(eval_ds.batch(range(i, min(i + s.micro_batch_size, s.eval_samples))))
                    for i in range(0, s.eval_samples, s.micro_batch_size)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None

    curve_path = None
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        curve_path = Path(out_dir) / "curve.csv"
        with open(curve_path, "w", newline="") as f:
            csv.DictWriter(f, CURVE_FIELDS).writeheader()
    rows: list[dict] = []
    train_losses: list[float] = []

    def record(step: int, lr: float):
        if autocast is not None:
            with autocast:
                ev = evaluate(model, eval_batches, mask_names, s.vocab_size)
        else:
            ev = evaluate(model, eval_batches, mask_names, s.vocab_size)
        row = {"arm": arm.name, "step": step, **ev,
               "train_loss": sum(train_losses) / len(train_losses) if train_losses else float("nan"),
               "lr": lr, "elapsed_s": round(time.time() - t0, 2)}
        train_losses.clear()
        rows.append(row)
        if curve_path is not None:
            with open(curve_path, "a", newline="") as f:
                csv.DictWriter(f, CURVE_FIELDS).writerow(row)
        if on_eval is not None:
            on_eval(row)
        log(f"[{arm.name}] step {step:>6} acc {row['accuracy']:.4f} acc_all "
            f"{row['accuracy_all']:.4f} loss {row['loss']:.4f} train_loss {row['train_loss']:.4f} "
            f"({row['elapsed_s']:.0f}s)")

    record(0, 0.0)
    n_micro = max(1, s.batch_size // s.micro_batch_size)
    for step in range(1, s.steps + 1):
        lr = _lr_at(s, step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        base = (step - 1) * s.batch_size
        step_loss = 0.0
        for m in range(n_micro):
            lo = base + m * s.micro_batch_size
            batch = to_dev(train_ds.batch(range(lo, min(lo + s.micro_batch_size,
                                                          base + s.batch_size))))
            if autocast is not None:
                with autocast:
                    losses = model(batch["tokens"], batch["position_ids"], None,
                                   labels=batch["labels"])
            else:
                losses = model(batch["tokens"], batch["position_ids"], None,
                               labels=batch["labels"])
            mask = batch["loss_mask"]
            loss = (losses.float() * mask).sum() / mask.sum().clamp(min=1.0)
            (loss / n_micro).backward()
            step_loss += float(loss.detach()) / n_micro
        if s.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip_grad)
        opt.step()
        if math.isfinite(step_loss):
            train_losses.append(step_loss)
        if step % s.eval_interval == 0 or step == s.steps:
            record(step, lr)
    wall = time.time() - t0
    return {"arm": arm.name, "rows": rows, "wall_s": wall, "params": params,
            "threads": torch.get_num_threads(), "pid": os.getpid()}
