"""wandb logging that survives restarts: one wandb run per kvtrain run folder.

Megatron-LM opens a new wandb run on every restart. Here the run id is created
once and kept in ``<run_dir>/wandb_run_id``; every later start of the same run
folder that resumes a checkpoint calls ``wandb.init(id=..., resume="allow")``,
so the dashboards show one continuous run. Metrics are plotted against
``iteration`` (declared as the step metric) rather than wandb's internal step, so
a resumed run that re-does steps lost to a crash draws over them instead of being
dropped as "non-monotonic". A start from step 0 in a folder that has an id
(its checkpoints deleted, ``checkpoint.dir`` moved) is another history: it gets
a new id, replacing the stored one, and the old wandb run is left as it was.

``mode: auto`` is offline unless ``WANDB_MODE`` says otherwise or an API key is
configured *and* the wandb host answers (an online init with no network would
block for minutes). The host is wandb's: ``WANDB_BASE_URL``'s for a self-hosted
server (where ``wandb login --host`` keeps its key in ~/.netrc), else api.wandb.ai. Only global rank 0 talks to wandb.

wandb only mirrors ``metrics.jsonl``: a wandb that fails to start, or whose
service dies mid-run (a preemption's SIGTERM reaches wandb-core too, and every
``log`` then raises), is dropped with one warning and the run goes on.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import sys
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import urlparse

from data_tools.fileio import atomic_write_text
from kvtrain.config import wandb_folder
from kvtrain.config.loader import first_line
from kvtrain.config.schema import WandbConfig

RUN_ID_FILE = "wandb_run_id"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what wandb generates ([a-z0-9]) and accepts


def _wandb_server() -> tuple[str, int]:
    """(host, port) of the wandb server the run would log to."""
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    return url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)


def _api_key_configured(host: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return host in netrc.read_text()
    except OSError:
        return False


def _host_reachable(host: str = "api.wandb.ai", port: int = 443, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_mode(cfg: WandbConfig) -> str:
    """online | offline | disabled, from the config, the environment and the network."""
    if not cfg.enabled or cfg.mode == "disabled":
        return "disabled"
    if cfg.mode != "auto":
        return cfg.mode
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    if env == "dryrun":
        return "offline"
    host, port = _wandb_server()
    if _api_key_configured(host) and _host_reachable(host, port):
        return "online"
    return "offline"


def stored_run_id(run_dir: Path) -> Optional[str]:
    """The run id kept in ``run_dir``; None if none, or (with one warning) if the
    file is unreadable or holds no wandb id: the run then logs to a new wandb run."""
    path = Path(run_dir) / RUN_ID_FILE
    try:
        run_id = path.read_text(encoding="utf-8").strip() if path.exists() else ""
    except (OSError, UnicodeDecodeError) as e:
        run_id, problem = None, f"unreadable ({first_line(e)})"
    else:
        problem = None if not run_id or _RUN_ID.fullmatch(run_id) else f"holds {run_id[:40]!r}"
    if problem:
        print(f"kvtrain: warning: {path} {problem}, not a wandb run id: logging to a new "
              "wandb run", flush=True)
        return None
    return run_id or None


def run_id_for(run_dir: Path, fresh: bool = False) -> str:
    """The wandb run id of ``run_dir``: read, or created and stored on first use;
    ``fresh`` (a start from step 0): a new one, replacing the stored one."""
    path = Path(run_dir) / RUN_ID_FILE
    run_id = None if fresh else stored_run_id(run_dir)
    if run_id:
        return run_id
    # wandb's own id format (8 of [a-z0-9]); its generator moved between releases
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))
    atomic_write_text(path, run_id + "\n")
    return run_id


# The module W&B Launch's staged inputs live in: only a script that calls
# wandb.launch.manage_config_file / manage_wandb_config before init imports it
_LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"


@contextlib.contextmanager
def _no_launch_input_lookup() -> Iterator[None]:
    """``wandb.init`` without its look for W&B Launch job inputs, where none can be
    staged (their module was never imported).

    Why: the look imports ``wandb.sdk.launch``, whose pydantic models read their
    field docstrings through ``inspect.getmodule``, which walks every module loaded
    (torch and megatron: thousands) per class: 1.5-3 s of rank 0's CPU at every
    start, while the other ranks wait for it at the first collective. Where inputs
    may be staged (a wrapper script imported the module), wandb looks as usual."""
    from wandb.sdk.wandb_run import Run

    look = getattr(Run, "_detect_and_apply_job_inputs", None)
    if look is None or _LAUNCH_INPUTS in sys.modules:
        yield
        return
    Run._detect_and_apply_job_inputs = lambda self: None
    try:
        yield
    finally:
        Run._detect_and_apply_job_inputs = look


class WandbLogger:
    """Rank 0's wandb run; a no-op object when wandb is disabled or on other ranks."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, run_name: str, config: dict,
                 active: bool = True, fresh: bool = False):
        """``fresh``: the run starts from step 0 (no checkpoint resumed), so it
        does not continue the wandb run this folder had."""
        self.mode = resolve_mode(cfg) if active else "disabled"
        self.run = None
        self.run_id: Optional[str] = None
        if self.mode == "disabled":
            if active and fresh:  # a later resume of this history must not log into the old run
                (Path(run_dir) / RUN_ID_FILE).unlink(missing_ok=True)
            return
        old = stored_run_id(run_dir) if fresh else None
        import wandb

        self.run_id = run_id_for(run_dir, fresh)
        if old:
            print(f"kvtrain: wandb: a start from step 0 logs to a new wandb run {self.run_id} "
                  f"(this folder's run {old} is another history, left as it was)", flush=True)
        wandb_dir = wandb_folder(cfg.dir, run_dir)
        try:  # a folder that cannot be made (checked at a training's start) loses wandb only
            wandb_dir.mkdir(parents=True, exist_ok=True)
            with _no_launch_input_lookup():
                self.run = wandb.init(
                    project=cfg.project,
                    entity=cfg.entity,
                    name=cfg.name or run_name,
                    group=cfg.group,
                    tags=list(cfg.tags) or None,
                    dir=str(wandb_dir),  # wandb writes into <dir>/wandb/
                    mode=self.mode,
                    id=self.run_id,
                    resume="allow",
                    config=config,
                    settings=wandb.Settings(
                        x_disable_stats=True,  # no system-metrics sampler thread next to training
                        console="off",  # stdout stays ours (the log lines are logged as metrics)
                        silent=True,
                        init_timeout=120,
                    ),
                )
            self.run.define_metric("iteration")
            self.run.define_metric("*", step_metric="iteration")
        except Exception as e:  # wandb's errors have no common base
            self._lost("did not start", e)

    @property
    def active(self) -> bool:
        return self.run is not None

    def log(self, metrics: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            self.run.log({k: v for k, v in metrics.items() if v is not None})
        except Exception as e:
            self._lost("stopped", e)

    def finish(self, exit_code: int = 0) -> None:
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish(exit_code=exit_code)
            except Exception as e:
                self._lost("could not finish", e)

    def _lost(self, what: str, error: Exception) -> None:
        """Goes on without wandb, saying so once (the next calls are no-ops)."""
        self.run = None
        print(f"kvtrain: warning: wandb {what} ({first_line(error)}); the run goes on "
              f"without it (metrics.jsonl has every record)", flush=True)
