"""wandb logging that survives restarts: one wandb run per kvtrain run folder.

Megatron-LM opens a new wandb run on every restart. Here the run id is created
once and kept in ``<run_dir>/wandb_run_id``; every later start of the same run
folder calls ``wandb.init(id=..., resume="allow")``, so the dashboards show one
continuous run. Metrics are plotted against ``iteration`` (declared as the step
metric) rather than wandb's internal step, so a resumed run that re-does steps
lost to a crash draws over them instead of being dropped as "non-monotonic".

``mode: auto`` is offline unless ``WANDB_MODE`` says otherwise or an API key is
configured *and* the wandb host answers (an online init with no network would
block for minutes). Only global rank 0 talks to wandb.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
from pathlib import Path
from typing import Any, Iterator, Optional

from kvtrain.config.schema import WandbConfig

RUN_ID_FILE = "wandb_run_id"


def _api_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
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
    if _api_key_configured() and _host_reachable(os.environ.get("WANDB_BASE_HOST", "api.wandb.ai")):
        return "online"
    return "offline"


def run_id_for(run_dir: Path) -> str:
    """The wandb run id of ``run_dir``: read, or created and stored on first use."""
    path = Path(run_dir) / RUN_ID_FILE
    if path.exists():
        run_id = path.read_text().strip()
        if run_id:
            return run_id
    # wandb's own id format (8 of [a-z0-9]); its generator moved between releases
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


class WandbLogger:
    """Rank 0's wandb run; a no-op object when wandb is disabled or on other ranks."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, run_name: str, config: dict,
                 active: bool = True):
        self.mode = resolve_mode(cfg) if active else "disabled"
        self.run = None
        self.run_id: Optional[str] = None
        if self.mode == "disabled":
            return
        import wandb

        self.run_id = run_id_for(run_dir)
        wandb_dir = Path(cfg.dir) if cfg.dir else Path(run_dir)
        wandb_dir.mkdir(parents=True, exist_ok=True)
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

    @property
    def active(self) -> bool:
        return self.run is not None

    def log(self, metrics: dict[str, Any]) -> None:
        if self.run is None:
            return
        self.run.log({k: v for k, v in metrics.items() if v is not None})

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


# ----------------------------------------------------------------------------- offline files
def offline_run_files(run_dir: str | Path) -> list[Path]:
    """The ``.wandb`` transaction logs under ``run_dir`` (one per process start)."""
    return sorted(Path(run_dir).glob("**/wandb/offline-run-*/run-*.wandb"))


def _records(path: Path) -> Iterator[bytes]:
    """Records of a .wandb file (LevelDB log format: 7-byte header, 32 KiB blocks of
    ``crc32c(4) length(2) type(1) payload`` chunks; type 1 full, 2/3/4 first/middle/last)."""
    data = path.read_bytes()
    block = 32768
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


def read_offline_run(path: str | Path) -> dict:
    """``{"run_id": ..., "history": [{key: value, ...}, ...]}`` of one .wandb file."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_id, history = None, []
    for payload in _records(Path(path)):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run" and record.run.run_id:
            run_id = record.run.run_id
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                try:
                    row[key] = json.loads(item.value_json)
                except (ValueError, TypeError):
                    row[key] = item.value_json
            history.append(row)
    return {"run_id": run_id, "history": history}
