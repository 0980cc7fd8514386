"""Distributed checkpoints (megatron ``dist_checkpointing``, torch_dist format).

Layout of ``checkpoint.dir`` (default ``<run_dir>/checkpoints``)::

    iter_0000100/          one checkpoint: torch_dist shards + common.pt + metadata.json
        kvtrain_checkpoint.json   written last, by rank 0: marks the checkpoint complete
                                  and lists its files (size, CRC-32: the manifest)
    iter_0000200.incomplete/      a checkpoint being written (renamed when complete)
    latest                 "iter_0000100": the newest *complete* checkpoint
    abandoned-<time>/      checkpoints of a history a resume did not continue

A checkpoint holds the model, the optimizer (distributed optimizer state in the
``fully_reshardable`` format), the LR scheduler, every rank's RNG states, the
iteration, consumed samples and the run config. Shards are written into
``iter_N.incomplete``; after every rank's shards are on disk (the writer
fsyncs them), rank 0 writes the marker, renames the folder to ``iter_N`` and
only then rewrites ``latest``, through a fsync'd temporary file and an atomic
rename. A process killed in the middle of a save therefore leaves ``latest``
naming the previous complete checkpoint; the half-written folder is removed
by the next save.

A save that fails (a full disk, a quota, a read-only filesystem) stops the
run: its ``.incomplete`` folder is removed, ``latest`` still names the
previous checkpoint, and ``CheckpointError`` says why in one line (the OS
error, e.g. "No space left on device", which megatron often buries or loses).
When it fails on one rank while the marker is made, or on rank 0 making the
checkpoint folder or ``iter_N.incomplete``, every rank stops with that rank's
reason (``save_agreement``), none waits in a collective for it.
Training on would fail every later save just the same, and a stop on a signal
must not exit 0 without its checkpoint; Megatron-LM stops too.

Resuming (``resume.resume``): the candidates of ``integrity.plan_resume``
are verified against their manifest (``checkpoint.verify``) and loaded in
order; one that is damaged or that megatron cannot load is skipped with one
warning (under ``resume: auto``; an explicit path fails), and the checkpoints
at or after the loaded iteration that were not loaded are set aside, never
deleted. The manifest, the verification levels and the choice of candidates
are described in ``integrity``.

The traps of megatron-core 0.16.1 (each measured, and each with a test), and where
each is handled:

1. ``fully_reshardable`` (``SHARDING_METADATA``): the default
   ``fully_sharded_model_space`` fails ("flattened_range is not supported");
   ``dp_reshardable`` cannot change TP. ``fully_reshardable`` loads into any
   TP/PP/DP layout.
2. Torch AdamW inside the distributed optimizer (every CPU run; no TE/apex):
   the optimizer state must exist before ``sharded_state_dict(is_loading=True)``
   (``_prime_optimizer_state``), the per-parameter ``step`` is not in the
   checkpoint (only one value per param group), and ``load_state_dict`` puts
   one *shared* step tensor in every parameter's state, so AdamW's in-place
   ``step += 1`` advances it once per parameter per update, corrupting bias
   correction. ``_fix_adam_steps`` gives every parameter its own tensor holding
   the restored update count, where the group's kernel reads it (the parameter's
   device for fused AdamW). The param groups come back from the checkpoint with
   their hyper-parameters and flags; the run's own are kept (``run_param_groups_kept``).
3. The writer's spawn-context ``multiprocessing.Manager`` re-imports the main
   module; a training script without a ``__main__`` guard would re-run itself
   in that child and hang the save. ``ensure_writer_queue`` gives synchronous
   saves an in-process queue (no manager at all) and starts the manager of
   asynchronous saves with the main module hidden from the child (see
   ``writer_queue``).
4. The state dict comes from the unwrapped models (GPTModel / Float16Module),
   not the DDP wrapper, which would prefix every key with ``module.``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException

from data_tools.fileio import atomic_write_text, fsync_dir
from kvtrain.config import ConfigError, on_every_rank
from kvtrain.config.compat import check_resume_config

from .checkpoint_readers import remove_unless_read
from .hooks import RunHooks
from .integrity import (
    INCOMPLETE, MARKER, PREFIX, TRACKER, CheckpointError, SaveFailed, build_manifest,
    carried_on, checkpoint_folders, own_shards, save_failure_reason, set_aside,
)
from .model_fit import check_same_optimizer, check_same_parameters, check_same_shapes
from .optimizer import (adam_step, fresh_adam_state, inner_optimizers, run_param_groups_kept,
                        zero_steps_restored)
from .rng_states import restore_rng_state, rng_sharded_object
from .save_agreement import gather_or_fail, on_rank0_or_fail
from .step import sync_params
from .writer_watch import SyncSaveWatch, check_async_writers, finalize_async

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SHARDING_METADATA = {
    # trap 1: the only optimizer format that loads into another TP/PP/DP layout
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}


@dataclass
class TrainState:
    """The loop's counters: everything besides tensors that a resume needs."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: Optional[int] = None  # counted (loop.count_tokens_from); None: not yet
    skipped_steps: int = 0  # optimizer updates dropped (non-finite, fp16 overflow)
    nonfinite_in_row: int = 0
    # [[index, crc32], ...] of a few training samples drawn (kvtrain/data/order.py):
    # a resume tells whether the dataset it builds still gives them
    data_order: Optional[list] = None
    # the explicit checkpoint.resume (resolved) this history began from; also in the
    # marker, where integrity.plan_resume finds a rerun's own checkpoints
    started_from: Optional[str] = None
    # the log window open at the save (loop.Window.saved): a resume logs its steps in
    # the next record, as the run would have, instead of losing them
    window: Optional[dict] = None
    extra: dict = field(default_factory=dict)


def checkpoint_name(iteration: int) -> str:
    return f"{PREFIX}{iteration:07d}"


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (not path.name.endswith(INCOMPLETE) and (path / MARKER).exists()
            and (path / "metadata.json").exists())


def _remove(path: Path) -> None:
    """Deletes a checkpoint folder; renamed first, so that a crash in the middle of
    the deletion never leaves a half folder under a checkpoint's name."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    except OSError as e:
        log.warning("could not remove old checkpoint %s: %s", path, e)


def prune(root: Path, keep: Path, keep_last: Optional[int]) -> None:
    """Drops half-written saves, and complete checkpoints beyond ``keep_last``
    (``keep`` and the newest ``keep_last - 1`` of the others, by iteration) that
    no other process reads (``checkpoint_readers``)."""
    complete = [p for p in checkpoint_folders(root) if p != keep and is_complete(p)]
    for p in [*root.glob(f"{PREFIX}*{INCOMPLETE}"), *root.glob(".trash-*")]:
        _remove(p)
    for p in complete[max(keep_last - 1, 0):] if keep_last is not None else []:
        remove_unless_read(p, _remove)


def _empty_folder(work: Path) -> None:
    if work.exists():  # leftovers of a save that was killed half-way
        shutil.rmtree(work)
    work.mkdir(parents=True)


def ensure_writer_queue(async_save: bool) -> None:
    """Gives megatron's torch_dist writer its results queue before the first save
    (trap 3, see ``writer_queue``): in-process for synchronous saves, a manager
    started without re-importing ``__main__`` for asynchronous ones."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from .writer_queue import results_queue

    current = filesystem_async._results_queue
    if current is None or (async_save and isinstance(current, queue.Queue)):
        filesystem_async._results_queue = results_queue(async_save)


def current_layout() -> dict:
    return {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "context": parallel_state.get_context_parallel_world_size(),
        "data": parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        "world": dist.get_world_size(),
    }


@contextmanager
def _step_free_param_state_load(optimizer):
    """trap 2b: a ``fully_reshardable`` checkpoint has no per-parameter ``step``
    (megatron keeps one per param group), but ``load_parameter_state_from_
    fully_reshardable`` copies *every* key of the live AdamW state from the
    checkpoint, and fails with ``KeyError: 'step'``. The steps are set aside
    while the parameter state loads; ``_fix_adam_steps`` then sets them."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(opt, "load_parameter_state_from_fully_reshardable", None)
        inner = getattr(opt, "optimizer", None)
        if original is None or inner is None:
            continue

        def load_without_step(state_dict, _original=original, _inner=inner):
            steps = {p: st.pop("step") for p, st in _inner.state.items() if "step" in st}
            try:
                _original(state_dict)
            finally:
                for p, step in steps.items():
                    _inner.state[p]["step"] = step

        opt.load_parameter_state_from_fully_reshardable = load_without_step
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.load_parameter_state_from_fully_reshardable  # back to the class method


# ----------------------------------------------------------------------------- checkpointer
class Checkpointer:
    """Saves and loads the whole training state of this rank's model chunks."""

    def __init__(self, root: Path, model_chunks: list, optimizer, scheduler, run_config: dict,
                 keep_last: Optional[int] = None, async_save: bool = False,
                 hooks: Optional[RunHooks] = None):
        self.root = Path(root)
        self.chunks = model_chunks  # DDP-wrapped: their deferred param all-gather
        # trap 4: the unwrapped modules (DDP's .module: GPTModel or Float16Module)
        self.modules = [getattr(m, "module", m) for m in model_chunks]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.run_config = run_config
        self.keep_last = keep_last
        self.hooks = hooks or RunHooks()
        self.rank = dist.get_rank()
        self._async_queue = None
        self._pending: tuple[Path, int] = (self.root, 0)  # the save in flight: folder, iteration
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._async_queue = AsyncCallsQueue(persistent=False)
        try:  # on every rank: none waits for a rank 0 that failed (a read-only filesystem)
            on_rank0_or_fail(lambda: self.root.mkdir(parents=True, exist_ok=True), self.root)
        except SaveFailed as e:
            raise on_every_rank(CheckpointError(
                f"cannot make the checkpoint folder {self.root}: {e}")) from None
        ensure_writer_queue(async_save)

    # -- state dicts --------------------------------------------------------------
    def _model_state(self) -> dict:
        if len(self.modules) == 1:
            return {"model": self.modules[0].sharded_state_dict(metadata=dict(SHARDING_METADATA))}
        return {f"model{i}": m.sharded_state_dict(metadata=dict(SHARDING_METADATA))
                for i, m in enumerate(self.modules)}

    def _sharded_state(self, state: Optional[TrainState], loading: bool, optimizer: bool,
                       rng: bool) -> dict:
        sd = self._model_state()
        if optimizer:
            if loading:
                self._prime_optimizer_state()
            else:  # every step so far skipped: the state AdamW's first update starts from
                fresh_adam_state(self.optimizer)
            sd["optimizer"] = self.optimizer.sharded_state_dict(
                sd, is_loading=loading, metadata=dict(SHARDING_METADATA))
            sd["opt_param_scheduler"] = self.scheduler.state_dict()
        if rng:
            sd["rng_state"] = rng_sharded_object()
        if state is not None:
            # Plain values: saved once (common.pt) and identical on every rank.
            sd["kvtrain"] = {"state": asdict(state), "layout": current_layout(),
                             "config": self.run_config, "version": FORMAT_VERSION}
        return sd

    def _prime_optimizer_state(self) -> None:
        """trap 2a: torch AdamW creates its state lazily; the distributed optimizer's
        ``sharded_state_dict(is_loading=True)`` needs it to exist."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None or len(inner.state) > 0:
                continue
            if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                # Runs a zero-gradient AdamW step on the main params; every value it
                # touches is overwritten by the load that follows.
                opt._init_optimizer_states_with_dummy_values()
            elif getattr(opt, "init_state_fn", None) is not None:
                opt.init_state_fn(inner, opt.config)

    def _fix_adam_steps(self) -> None:
        """trap 2b/2c: one step tensor of its own per parameter, equal to the number
        of updates applied (= the scheduler's count; skipped steps advance neither),
        on the device the group's kernel reads it from (``optimizer.adam_step``: the
        parameter's for fused AdamW, whatever device the checkpoint's step was on)."""
        updates = float(self.scheduler.num_steps)
        for inner in inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    state = inner.state.get(p)
                    if not state:
                        continue
                    old = state.get("step")
                    state["step"] = adam_step(group, p, updates,
                                              old.dtype if torch.is_tensor(old) else None)

    # -- save ---------------------------------------------------------------------
    def save(self, state: TrainState) -> Path:
        """Saves a checkpoint of ``state.iteration`` on every rank (collective).

        The shards are written to ``iter_N.incomplete``; once every rank is done,
        rank 0 adds the marker, renames the folder to ``iter_N`` (replacing an
        older ``iter_N`` of an abandoned history, if any) and moves ``latest``.
        A folder named ``iter_N`` is therefore always complete.
        """
        self.finalize(blocking=True)  # one save in flight at a time
        sync_params(self.chunks)  # the updated weights, not one step old (overlap_param_gather)
        # The loop goes on mutating its state while an async save is written.
        state = copy.deepcopy(state)
        work = self.root / (checkpoint_name(state.iteration) + INCOMPLETE)
        self._pending = (work, state.iteration)
        with self._save_failure():  # a read-only folder: one line on every rank
            on_rank0_or_fail(lambda: _empty_folder(work), self.root)
        t0 = time.monotonic()
        sd = self._sharded_state(state, loading=False, optimizer=True, rng=True)
        # a synchronous save waits for the writer processes it forks: one that dies
        # (the OOM killer) ends this process in one line rather than a hang
        watch = nullcontext() if self._async_queue is not None else SyncSaveWatch(
            lambda why: f"kvtrain: {CheckpointError.kind}: " + self._failed(
                work, state.iteration, f"rank {self.rank}: {why}", removed=False))
        with self._save_failure(), watch:
            request = dist_checkpointing.save(
                sd, str(work), async_sharded_save=self._async_queue is not None,
                content_metadata={"kvtrain_format": FORMAT_VERSION},
            )
            finalize = lambda: self._mark_complete(work, state, time.monotonic() - t0)  # noqa: E731
            if request is None:
                finalize()
            else:
                request.add_finalize_fn(finalize)
                self._async_queue.schedule_async_request(request)
        return self.root / checkpoint_name(state.iteration)

    @contextmanager
    def _save_failure(self):
        """A failed save (``self._pending``) becomes one line: why (the OS error),
        which checkpoint; its ``.incomplete`` folder is removed and ``latest``
        keeps naming the previous checkpoint (it only moves after a complete save)."""
        try:
            yield
        except (Exception, CheckpointException) as e:  # torch's is a BaseException
            work, iteration = self._pending
            reason = save_failure_reason(e, self.root)  # before the removal frees space
            shutil.rmtree(work, ignore_errors=True)
            error = CheckpointError(self._failed(work, iteration, reason))
            if isinstance(e, SaveFailed):  # the ranks agreed on it (save_agreement)
                on_every_rank(error)
            raise error from e

    def _failed(self, work: Path, iteration: int, reason: str, removed: bool = True) -> str:
        """The line of a failed save (without its ``kvtrain: checkpoint error:``)."""
        gone = "the incomplete folder was removed and " if removed else ""
        return (f"saving the checkpoint of iteration {iteration} ({work.name}) failed: {reason}; "
                f"{gone}{self.root / TRACKER} is unchanged")

    def _mark_complete(self, work: Path, state: TrainState, seconds: float) -> None:
        """Runs on every rank once all shards are written (megatron's finalize, which
        writes metadata.json, has gathered every rank's results before this). A step
        that fails on any rank stops every rank with its reason (``save_agreement``)."""
        dist.barrier()

        def own_part() -> dict:
            self.hooks.shards_written(work, state.iteration)
            return own_shards(work, self.rank)  # checksums, while in the page cache

        checksums = gather_or_fail(own_part, self.root)
        on_rank0_or_fail(lambda: self._publish(work, state, seconds, checksums), self.root)
        self.hooks.checkpoint_saved(self.root / checkpoint_name(state.iteration), state.iteration)

    def _publish(self, work: Path, state: TrainState, seconds: float, checksums: list) -> None:
        """Rank 0: the marker with the manifest, the rename to ``iter_N``, then ``latest``."""
        known = {k: v for part in checksums for k, v in part.items()}
        info = {"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                "layout": current_layout(), "format": "torch_dist",
                "version": FORMAT_VERSION, "saved_at": time.time(),
                "save_seconds": round(seconds, 3),
                "manifest": build_manifest(work, known)}
        if state.started_from is not None:
            info["started_from"] = state.started_from
        atomic_write_text(work / MARKER, json.dumps(info, indent=1) + "\n")
        final = self.root / checkpoint_name(state.iteration)
        if final.exists():  # same iteration from a history not loaded: kept aside
            set_aside(self.root, [final])
        os.replace(work, final)
        fsync_dir(os.fspath(self.root))
        atomic_write_text(self.root / TRACKER, final.name + "\n")
        self._cleanup(keep=final)

    def _cleanup(self, keep: Path) -> None:
        """Rank 0: drops half-written saves and complete checkpoints beyond keep_last
        (the newest by iteration, not by name: iter_10000000 sorts before iter_9999000)."""
        prune(self.root, keep, self.keep_last)

    def finalize(self, blocking: bool = False) -> None:
        """Completes finished async saves (collective: call on every rank); ``blocking``:
        waits for them. A writer that died on any rank fails the save on every rank
        (megatron's own blocking wait would wait for it forever)."""
        queue = self._async_queue
        if queue is None or not queue.get_num_unfinalized_calls():
            return
        with self._save_failure():
            while True:
                check_async_writers(queue)
                finalize_async(queue, self.rank)
                if not blocking or not queue.get_num_unfinalized_calls():
                    return
                time.sleep(0.05)

    def close(self) -> None:
        self.finalize(blocking=True)

    # -- load ---------------------------------------------------------------------
    def load(self, path: Path, load_optimizer: bool = True, load_rng: bool = True,
             own: bool = False) -> TrainState:
        """Loads ``path`` into the model (and optimizer, scheduler, RNG) of this rank.

        Works from any TP/PP/DP layout to any other; the RNG states are only
        restored when the layout is the one they were saved from. ``own``: a checkpoint
        of this run's history (not ``checkpoint.resume``'s path), where what
        ``load_optimizer``/``load_rng`` false started afresh goes on (:func:`carried_on`).
        """
        path = Path(path)
        common = dist_checkpointing.load_common_state_dict(str(path))
        meta = common.get("kvtrain", {})
        if meta.get("weights_only") and load_optimizer:  # e.g. kvtrain import hf
            raise ConfigError(f"checkpoint {path} holds weights only (no optimizer state): "
                              "start from it with checkpoint.load_optimizer: false")
        changes = check_resume_config(
            meta.get("config"), self.run_config,
            self.run_config.get("checkpoint", {}).get("allow_config_changes", []),
            where=f"checkpoint {path}")
        # (a precision change without the distributed optimizer loads weights only)
        load_optimizer, load_rng, carried = carried_on(
            path, meta, own, load_optimizer, load_rng,
            optimizer_too=not any(c.key == "train.precision" for c in changes))
        if load_optimizer:
            check_same_optimizer(path, meta.get("config"), self.run_config)
        saved_layout = meta.get("layout")
        # checkpoints from before context parallelism have no "context": it was 1
        same_layout = saved_layout is not None and {"context": 1, **saved_layout} == current_layout()
        rng = load_rng and same_layout
        sd = self._sharded_state(None, loading=True, optimizer=load_optimizer, rng=rng)
        check_same_shapes(path, sd, changes, self.run_config.get("model", {}),  # megatron's
                          parallel_state.get_tensor_model_parallel_world_size())  # names none
        loaded, in_checkpoint_only, in_model_only = dist_checkpointing.load(
            sd, str(path), strict=StrictHandling.RETURN_ALL)
        check_same_parameters(path, in_checkpoint_only, in_model_only)
        if len(self.modules) == 1:
            self.modules[0].load_state_dict(loaded["model"], strict=True)
        else:
            for i, m in enumerate(self.modules):
                m.load_state_dict(loaded[f"model{i}"], strict=True)
        if load_optimizer:
            with _step_free_param_state_load(self.optimizer), \
                    run_param_groups_kept(self.optimizer):  # the config's lr, betas, ...
                zero_steps_restored(loaded["optimizer"])  # saved before the first update
                self.optimizer.load_state_dict(loaded["optimizer"])
            self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
            self._fix_adam_steps()
        else:
            self.optimizer.reload_model_params()  # main params <- loaded weights
        kept_back = (None if rng else
                     "checkpoint.load_rng: false" if not load_rng else "layout changed")
        if rng:
            states = loaded["rng_state"]
            dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
            kept_back = restore_rng_state(states[dp_rank])
        state = TrainState(**meta.get("state", {}))
        if not load_optimizer:
            state.nonfinite_in_row = 0
        state.extra = {"same_layout": same_layout, "rng_kept_back": kept_back,
                       "saved_layout": saved_layout, "config_changes": changes,
                       "carried_on": carried, "saved_schedule":
                           dict(loaded["opt_param_scheduler"]) if load_optimizer else None}
        return state

