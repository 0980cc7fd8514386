"""The training loop, and ``train()``: set up, resume, loop, save, clean up.

The loop itself only sequences the pieces: a step (``step.train_step``),
then whatever is due at this iteration - a log line, KV-shift statistics,
validation, a checkpoint - unless the step stops the run: the stop conditions,
which every rank evaluates on the same all-reduced flags so all ranks leave at
the same step, go straight to the save.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from data_tools.fileio import atomic_write_text
from kvtrain.backend import init_process_group
from kvtrain.config import ConfigError, RunConfig, TrainConfig, checkpoint_folder, on_every_rank
from kvtrain.config.checks import setting_warnings
from kvtrain.data.loader import loader_deaths_named
from kvtrain.data.order import order_changed, order_fingerprint
from kvtrain.tasks.config import accuracy_masks

from .checkpoint import Checkpointer, TrainState
from .evaluation import Validator, gather_shift_coefficients, shift_statistics
from .hooks import RunHooks
from .integrity import iteration_of, plan_resume, read_tracker
from .metrics import MetricsLogger, log_kept_writing, peak_memory_gib, say
from .optimizer import current_lr, schedule_moved
from .processes import bind_to_launcher
from .profiling import StepProfiler, check_profile_start
from .resume import resume
from .runlock import SAME_JOB_WAIT, hold_run_folder, removed_on_bad_input
from .setup import (
    Run, backend_event, build_data, build_run, fit_token_budget, run_config_text, run_record,
    write_run_config,
)
from .signals import StopRequests
from .step import ForwardStep, StepResult, sync_params, train_step
from .wandb_logger import WandbLogger

EXIT_OK = 0
EXIT_NONFINITE = 3  # stopped after train.max_consecutive_nonfinite bad steps (checkpoint saved)


def _due(iteration: int, interval: Optional[int]) -> bool:
    return bool(interval) and iteration % interval == 0


def training_loop(run: Run, state: TrainState, ckpt: Checkpointer, metrics: MetricsLogger,
                  validators: list[Validator], stop: StopRequests, hooks: RunHooks,
                  profiler: StepProfiler) -> int:
    """Trains from ``state`` to the end of the run (or a stop); returns the exit code."""
    cfg, t = run.cfg, run.cfg.train
    iterators = _data_iterators(run, state.consumed_samples)
    forward_step = ForwardStep(hooks, run.documents, vocab_size=cfg.model.vocab_size)
    window = Window.resumed(state.window)
    last_saved = state.iteration if state.iteration > 0 else None
    exit_code, why = EXIT_OK, None
    while state.iteration < run.total_steps:
        forward_step.iteration = state.iteration + 1
        started = time.perf_counter()
        signal_flag = max(stop.signal_flag, float(hooks.stop_requested(state.iteration + 1)))
        with profiler.step(state.iteration + 1):  # a trace, where profile asks for one
            result = train_step(run.forward_backward, forward_step, iterators, run.model,
                                run.optimizer, run.scheduler, run.num_microbatches,
                                t.seq_length, t.micro_batch_size, (signal_flag, stop.time_flag))
        state.iteration += 1
        state.consumed_samples += t.global_batch_size
        state.consumed_tokens += t.global_batch_size * t.seq_length
        window.add(result, time.perf_counter() - started)
        _count_skips(state, result, metrics)
        stopped = _stop_reason(state, result, t, stop.received)

        # a last step logs its partial window before its save: a window kept in the
        # checkpoint is one no record holds yet (a resume logs it once)
        if _due(state.iteration, t.log_interval) or stopped or state.iteration >= run.total_steps:
            metrics.write(window.flush(run, state))
        if stopped:
            # The save comes first: a signal's margin (--signal-seconds) or the time
            # left by exit_duration_minutes is for it, and a validation ate into it
            # (the time limit could kill the save, or the batch script's requeue).
            # The validation and α/β statistics due at this step are not taken: the
            # resume starts at the next step, so their curves miss this one point;
            # a stop on the run's last step takes them after the save (_wrap_up).
            exit_code, why = stopped
            break
        if cfg.model.attention == "kv_shift" and _due(state.iteration, t.kv_shift_stats_interval):
            _log_shift_stats(run, state, metrics)
        if _due(state.iteration, t.eval_interval):
            _validate(run, validators, state, metrics)
        ckpt.finalize()  # completes a finished async save, if any
        if _due(state.iteration, cfg.checkpoint.save_interval):
            _save(ckpt, run, state, window)
            last_saved = state.iteration
    # a stop saves where its step's interval asks for one too (save_on_exit false)
    c = cfg.checkpoint
    if (c.save_on_exit or (why and _due(state.iteration, c.save_interval))) and \
            last_saved != state.iteration and state.iteration > 0:
        _save(ckpt, run, state, window)
        last_saved = state.iteration
    _wrap_up(run, state, validators, metrics, stopped=why is not None)  # after a stop too
    ckpt.close()  # waits for an async save to complete
    done = f"iteration {state.iteration}/{run.total_steps}"
    saved = f"; checkpoint {ckpt.root}/latest = iteration {last_saved}" if last_saved else ""
    if why:
        metrics.write({"kind": "event", "iteration": state.iteration, "message": f"stopped: {why}"},
                      echo=False)
        say(f"kvtrain: stopped at {done} because of {why}{saved}")
    else:
        say(f"kvtrain: finished at {done}{saved}")
    return exit_code


# ----------------------------------------------------------------------------- helpers of the loop
def _stop_reason(state: TrainState, result: StepResult, t: TrainConfig,
                 received: Optional[str]) -> Optional[tuple[int, str]]:
    """The exit code and the reason to stop after this step (None: go on);
    ``received``: the stop signal this rank got, if any (another rank's is unnamed)."""
    if state.nonfinite_in_row >= t.max_consecutive_nonfinite:
        return EXIT_NONFINITE, (
            f"{state.nonfinite_in_row} steps in a row had a non-finite loss or gradient norm "
            f"(train.max_consecutive_nonfinite); their updates were skipped, so the weights "
            f"are those of the last good step")
    if result.stop_signal or result.time_up:
        if not result.stop_signal:
            return EXIT_OK, f"train.exit_duration_minutes ({t.exit_duration_minutes})"
        return EXIT_OK, ("Ctrl-C (SIGINT)" if received == "SIGINT" else
                         f"a stop signal ({received or 'SIGTERM/SIGUSR1/SIGINT'})")
    return None


def _wrap_up(run: Run, state: TrainState, validators: list[Validator],
             metrics: MetricsLogger, stopped: bool) -> None:
    """At the run's last step (stopped there or not): the final weights' α/β
    statistics and validation where no interval took them (a resume of a run
    stopped there has nothing left to do, so they would never be taken); a stop
    skipped those of its step in the loop."""
    cfg, t = run.cfg, run.cfg.train
    if state.iteration < run.total_steps:
        return
    if cfg.model.attention == "kv_shift" and t.kv_shift_stats_interval and \
            (stopped or not _due(state.iteration, t.kv_shift_stats_interval)):
        _log_shift_stats(run, state, metrics)
    if t.eval_interval and (stopped or not _due(state.iteration, t.eval_interval)):
        _validate(run, validators, state, metrics)


def _data_iterators(run: Run, consumed_samples: int) -> list:
    """One micro-batch iterator per model chunk (virtual stages each read the
    same micro batches), starting at ``consumed_samples``."""
    from kvtrain.data import micro_batches

    t = run.cfg.train
    return [micro_batches(run.datasets.train, consumed_samples, t.micro_batch_size, run.dp_rank,
                          run.dp_size, run.cfg.data.num_workers, seed=t.seed) for _ in run.model]


def _save(ckpt: Checkpointer, run: Run, state: TrainState, window: Window) -> None:
    state.data_order = order_fingerprint(run.datasets.train, state.consumed_samples)
    state.window = window.saved()
    ckpt.save(state)


def _order_warning(run: Run, state: TrainState) -> Optional[str]:
    """The resumed run's training data gives other samples than the checkpoint's drew:
    megatron orders them for the count a run asks for (kvtrain/data/order.py)."""
    if not order_changed(run.datasets.train, state.data_order):
        return None
    return (f"the training data's order changed since the checkpoint (megatron orders the "
            f"samples for the number a run asks for: train.max_steps or train.train_tokens "
            f"past an epoch, data.*, or a shard written again under its name changed it): "
            f"from sample {state.consumed_samples} on this run draws from the new order, "
            f"and samples already trained on may come again")


def count_tokens_from(state: TrainState, t: TrainConfig) -> None:
    """Starts the token count of a fresh run, or of a checkpoint from before it was
    counted: its samples at its own sequence length. The count is kept, not derived
    from consumed_samples, as train.seq_length may change on a resume
    (checkpoint.allow_config_changes; the change names the checkpoint's length)."""
    if state.consumed_tokens is None:
        saved = {c.key: c.saved for c in state.extra.get("config_changes") or []}
        state.consumed_tokens = state.consumed_samples * saved.get("train.seq_length",
                                                                   t.seq_length)


def _count_skips(state: TrainState, result: StepResult, metrics: MetricsLogger) -> None:
    skipped = result.outcome.skipped
    if skipped is None:
        state.nonfinite_in_row = 0
        return
    state.skipped_steps += 1
    if skipped == "nonfinite":
        state.nonfinite_in_row += 1
    metrics.write({"kind": "event", "iteration": state.iteration, "skipped": skipped,
                   "message": f"update skipped ({skipped}): lm_loss {result.loss}, "
                              f"grad_norm {result.outcome.grad_norm}",
                   "lm_loss": result.loss, "grad_norm": result.outcome.grad_norm,
                   "skipped_steps": state.skipped_steps,
                   "nonfinite_in_row": state.nonfinite_in_row})


def _log_shift_stats(run: Run, state: TrainState, metrics: MetricsLogger) -> None:
    sync_params(run.model)  # the coefficients of this step's update on every rank
    coefs = gather_shift_coefficients([m.module for m in run.model])  # collective
    if coefs is not None:
        metrics.write(shift_statistics(coefs, state.iteration))


def _validate(run: Run, validators: list[Validator], state: TrainState,
              metrics: MetricsLogger) -> None:
    sync_params(run.model)  # evaluate the updated weights (overlap_param_gather)
    for validator in validators:  # the run's validation, then data.valid_sets in order
        record = validator.run(state.iteration)  # collective
        if record is not None:
            metrics.write(record)


def _validators(run: Run) -> list[Validator]:
    """The run's validation (data.split's part, or data.valid_paths) and one per
    named set of data.valid_sets."""
    cfg, t = run.cfg, run.cfg.train
    common = dict(forward_backward=run.forward_backward, model=run.model,
                  eval_iters=t.eval_iters, global_batch_size=t.global_batch_size,
                  micro_batch_size=t.micro_batch_size, num_microbatches=run.num_microbatches,
                  seq_length=t.seq_length, vocab_size=cfg.model.vocab_size,
                  documents=run.documents)
    main = Validator(run.datasets.valid, accuracy_masks=accuracy_masks(cfg.data),
                     source="data.valid_paths" if cfg.data.valid_paths else "data.paths",
                     **common)
    return [main] + [Validator(dataset, source=f"data.valid_sets.{name}", name=name, **common)
                     for name, dataset in run.datasets.valid_sets.items()]


def _record_config_changes(state: TrainState, metrics: MetricsLogger) -> None:
    """Allowed differences between the checkpoint's config and the run's
    (``checkpoint.allow_config_changes``): printed and kept in metrics.jsonl."""
    changes = state.extra.get("config_changes") or []
    if changes:
        message = "config changed since the checkpoint: " + "; ".join(map(str, changes))
        say(f"kvtrain: {message}")
        metrics.write({"kind": "event", "iteration": state.iteration, "message": message,
                       "changes": {c.key: [c.saved, c.current] for c in changes}}, echo=False)


@dataclass
class Window:
    """Steps since the last log line: losses, step times, the last grad norm.

    The record tells what the window's steps did, skipped ones included: the
    loss is the mean over the steps whose loss was finite (a step skipped for a
    non-finite gradient or an fp16 overflow still measured a true loss), the
    grad norm is the last step's own (non-finite or None when that step was
    skipped), and ``skipped_in_window`` says how many updates were dropped."""

    steps: int = 0
    losses: list = field(default_factory=list)
    seconds: float = 0.0
    grad_norm: Optional[float] = None
    skipped: int = 0

    def add(self, result: StepResult, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        if math.isfinite(result.loss):
            self.losses.append(result.loss)
        self.grad_norm = result.outcome.grad_norm
        self.skipped += result.outcome.skipped is not None

    def saved(self) -> Optional[dict]:
        """The steps not yet logged, for a checkpoint (None: none)."""
        if not self.steps:
            return None
        return {"steps": self.steps, "losses": list(self.losses), "seconds": self.seconds,
                "grad_norm": self.grad_norm, "skipped": self.skipped}

    @classmethod
    def resumed(cls, saved: Optional[dict]) -> "Window":
        """The window a checkpoint saved (:meth:`saved`; None: a new one)."""
        return cls(**saved) if saved else cls()

    def flush(self, run: Run, state: TrainState) -> dict:
        """The train record of the window (collective: peak memory is a max over ranks)."""
        t = run.cfg.train
        step_time = self.seconds / max(self.steps, 1)
        tflops = run.flops_per_step / step_time / run.world_size / 1e12
        memory, memory_kind = peak_memory_gib()
        peak = torch.tensor([memory], dtype=torch.float64)
        if torch.cuda.is_available():
            peak = peak.cuda()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        record = {
            "kind": "train",
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "consumed_tokens": state.consumed_tokens,
            "lm_loss": sum(self.losses) / len(self.losses) if self.losses else float("nan"),
            "lr": current_lr(run.optimizer),
            "grad_norm": self.grad_norm,
            "step_time_s": step_time,
            "tokens_per_s": t.global_batch_size * t.seq_length / step_time,
            "tflops_per_device": tflops,
            "mfu": tflops / run.peak_tflops if run.peak_tflops else None,
            "peak_memory_gib": float(peak.item()),
            "memory_kind": memory_kind,
            "skipped_steps": state.skipped_steps,
            "steps_in_window": self.steps,
            "skipped_in_window": self.skipped,
        }
        if run.cfg.train.precision == "fp16" or getattr(run.optimizer, "grad_scaler", None):
            record["loss_scale"] = float(run.optimizer.get_loss_scale().item())
        self.steps, self.losses, self.seconds, self.skipped = 0, [], 0.0, 0
        return record


# ----------------------------------------------------------------------------- the entry point
@contextmanager
def _refused_alike():
    """A start refused for bad input found as the run is built (a missing shard, a
    tokenizer that does not fit, a checkpoint that does not) is refused alike by
    every rank: each reads the same config and files. So it is one line a node
    (``kvtrain.cli.report``), not one a rank."""
    try:
        yield
    except ConfigError as e:
        on_every_rank(e)
        raise


def train(cfg: RunConfig, run_dir: Path, hooks: Optional[RunHooks] = None,
          status_file: Optional[Path] = None) -> int:
    """Runs (or resumes) the run of ``cfg`` in ``run_dir`` on this rank; returns the
    exit code (0: finished or stopped on request; 3: too many non-finite steps).
    ``hooks`` observe or steer the run at fixed points (``hooks.RunHooks``).
    ``status_file`` (rank 0) says at the end whether the run is finished: both
    end with exit 0, and a launcher starts a stopped run again, not a finished one."""
    hooks = hooks or RunHooks()
    bind_to_launcher()  # this rank dies with its launcher, its helpers with it
    init_process_group(cfg.train.dist_timeout_minutes, device=cfg.train.device)
    # a requeued job's wait for its own earlier lock: within the collectives' timeout
    wait = min(SAME_JOB_WAIT, cfg.train.dist_timeout_minutes * 30)
    lock = hold_run_folder(Path(run_dir), wait=wait)  # one writer per run folder (collective)
    stop = StopRequests(cfg.train.exit_duration_minutes,
                        announce=os.environ.get("LOCAL_RANK", "0") == "0").install()
    try:  # however it ends, the signals are given back before the CLI says why: the
        # launcher's SIGTERM ends the ranks that wait to leave a refusal to the first
        with log_kept_writing():  # a log on a full disk: lines missing, not the run
            return _train(cfg, Path(run_dir), hooks, status_file, lock, stop, wait)
    finally:
        stop.restore()
        if lock is not None:
            lock.release()


def _train(cfg: RunConfig, run_dir: Path, hooks: RunHooks, status_file: Optional[Path],
           lock, stop: StopRequests, wait: float) -> int:
    """``train`` once this rank holds the run folder and its stop requests."""
    with removed_on_bad_input(run_dir, lock), _refused_alike():  # no new folder left
        # also where checkpoint.dir lies outside the run folder (or in another's)
        shared = hold_run_folder(checkpoint_folder(cfg.checkpoint.dir, run_dir),
                                 "checkpoint folder", wait)
        if lock is not None:
            lock.hold_too(shared)
        run = build_run(cfg, run_dir, data=False)  # the data once the start is known
        rank0 = run.rank == 0
        text = _announce(run) if rank0 else None
        ckpt = Checkpointer(run.checkpoint_dir, run.model, run.optimizer, run.scheduler,
                            run_record(cfg, run.resolved), keep_last=cfg.checkpoint.keep_last,
                            async_save=cfg.checkpoint.async_save, hooks=hooks)
        c = cfg.checkpoint  # a damaged candidate is skipped with a warning (checkpoint.resume)
        resumed = resume(ckpt, plan_resume(c.resume, run.checkpoint_dir), c.verify,
                         c.load_optimizer, c.load_rng)
        count_tokens_from(resumed.state, cfg.train)  # what the budget left is counted from
        budget = fit_token_budget(run, resumed.state)
        if budget:  # another global batch since the checkpoint
            resumed.add(f"kvtrain: {budget}")
        moved = schedule_moved(run.scheduler, resumed.state.extra.get("saved_schedule"))
        if moved:  # a decaying schedule whose end moved (train.max_steps raised, say)
            resumed.add(f"kvtrain: warning: {moved}")
        build_data(run, resumed.state)  # for what this start draws (the end may have moved)
        check_profile_start(cfg.profile, run.device, run.total_steps, run.run_dir, run.rank)
        validators = _validators(run)
        trains = resumed.state.iteration < run.total_steps
        if trains:
            for validator in validators:  # a bad id in them: one line now, not mid-run
                validator.check_token_ids()
        # once the start is taken: a refused one leaves the config of the records, and
        # so does one with nothing left to train (its changed keys trained nothing)
        if rank0 and (trains or not (run.run_dir / "config.yaml").exists()):
            write_run_config(text, run.run_dir)  # the text printed above
    state = resumed.state
    order = _say_resumed(run, resumed)
    wandb = WandbLogger(cfg.wandb, run.run_dir, cfg.name, run_record(cfg, run.resolved),
                        active=rank0, fresh=resumed.path is None)
    metrics = MetricsLogger(run.run_dir, wandb, active=rank0)
    # records past the checkpoint are dropped (a fresh start in a folder with records,
    # checkpoints deleted or checkpoint.dir moved, drops them all: another history,
    # kept in a copy); trained iterations no record stands for are named (a full disk)
    metrics.resume_at(state.iteration, keep_copy=resumed.fell_back or resumed.path is None,
                      logged_through=state.iteration - (state.window or {}).get("steps", 0))
    metrics.write(backend_event(run, state.iteration), echo=False)
    for note in resumed.notes + ([order] if order else []):
        metrics.write({"kind": "event", "iteration": state.iteration, "message": note}, echo=False)
    _record_config_changes(state, metrics)
    profiler = StepProfiler.for_start(cfg.profile, run.run_dir, run.rank, run.device,
                                      state.iteration + 1, run.total_steps, metrics)
    code = 1
    try:
        if state.iteration >= run.total_steps:
            say(f"kvtrain: nothing to do: iteration {state.iteration} >= {run.total_steps} steps")
            code = EXIT_OK
        else:
            with loader_deaths_named(cfg.data.num_workers), \
                    _interrupted_said(run, ckpt, state, metrics):
                code = training_loop(run, state, ckpt, metrics, validators, stop, hooks,
                                     profiler)
        if status_file is not None and rank0:
            _write_status(status_file, state.iteration, run.total_steps)
    finally:
        profiler.close()  # a stop inside its window: what was traced
        metrics.close()
        wandb.finish(exit_code=code)
    return code


@contextmanager
def _interrupted_said(run: Run, ckpt: Checkpointer, state: TrainState,
                      metrics: MetricsLogger):
    """A second Ctrl-C (``signals.StopRequests``) quits without saving: one line
    says where the run continues from, then the CLI exits 130."""
    try:
        yield
    except KeyboardInterrupt:
        latest, _ = read_tracker(ckpt.root)
        saved = iteration_of(latest) if latest else None
        where = (f"it continues from its checkpoint of iteration {saved} ({latest})"
                 if latest else "with no checkpoint, it starts over")
        unsaved = "" if saved == state.iteration else " with no checkpoint of it"
        message = f"interrupted at iteration {state.iteration}/{run.total_steps}{unsaved}; {where}"
        metrics.write({"kind": "event", "iteration": state.iteration, "message": message},
                      echo=False)
        say(f"kvtrain: {message}")
        raise


def _announce(run: Run) -> str:
    """Prints the run folder, the resolved config, the layout, the backend and the MFU
    basis (rank 0, at every start); returns the config's text for config.yaml."""
    cfg = run.cfg
    text = run_config_text(cfg, run.resolved)
    say(f"kvtrain: run folder {run.run_dir.resolve()}\n--- resolved config ---\n"
        f"{text}--- layout: world {run.world_size} = TP {cfg.parallel.tensor} x PP "
        f"{cfg.parallel.pipeline} x DP {run.dp_size}; {run.num_microbatches} micro "
        f"batches per step; {run.total_steps} steps")
    say(f"kvtrain: {run.backend.describe()}, device {run.device}, precision {run.precision}")
    say(f"kvtrain: MFU against {run.mfu_basis}")
    if run.backend.warning:
        say(f"kvtrain: warning: {run.backend.warning}")
    for warning in setting_warnings(cfg, run.total_steps):
        say(f"kvtrain: warning: {warning}")
    return text


def _say_resumed(run: Run, resumed) -> Optional[str]:
    """Says where a resumed run starts; returns its data-order warning, if any."""
    if resumed.path is None:
        return None
    state = resumed.state
    order = _order_warning(run, state)
    why = state.extra.get("rng_kept_back")
    note = f" (RNG states not restored: {why})" if why else ""
    say(f"kvtrain: resumed from {resumed.path} at iteration {state.iteration}{note}")
    if order:
        say(f"kvtrain: warning: {order}")
    return order


def _write_status(path: Path, iteration: int, total_steps: int) -> None:
    """``finished I/T`` or ``stopped I/T``, in one line (``kvtrain train --status-file``)."""
    outcome = "finished" if iteration >= total_steps else "stopped"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, f"{outcome} {iteration}/{total_steps}\n")
    except OSError as e:  # the training and its checkpoint are done: a warning, not a failure
        say(f"kvtrain: warning: could not write the status file {path}: {e}")
