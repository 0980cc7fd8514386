"""``kvtrain submit CONFIG --nodes N ...``: fill in launch/slurm.sbatch and call sbatch.

Checks the config first (on N x GPUs-per-node ranks, and with ``kvtrain plan``'s
memory estimate on GPU runs), then submits one job - or a chain of ``--chain
K`` jobs with the same name and ``--dependency=singleton``, each starting when
the previous one ends and resuming from its checkpoint. The name is the run
folder's, so jobs of other run folders (a sweep) are not held back.
``--dry-run`` prints the commands instead. ``--gpus-per-node 0`` submits a CPU
job (gloo; one process per CPU of the node unless ``--nproc-per-node``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from itertools import takewhile
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "submit",
        help="submit a training run to SLURM (launch/slurm.sbatch)",
        description="Submit CONFIG to SLURM: one torchrun per node, c10d rendezvous on the "
                    "first node, checkpoint and requeue before the time limit.",
    )
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node (default 8); 0 for a CPU-only job")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per node (default: the GPUs, or the node's CPUs)")
    from kvtrain.plan.flops import GPUS

    p.add_argument("--gpu", choices=sorted(GPUS), default="a100",
                   help="GPU kind for kvtrain plan's memory check (default a100)")
    p.add_argument("--partition", "-p", help="SLURM partition")
    p.add_argument("--account", "-A", help="SLURM account")
    p.add_argument("--qos", help="SLURM QOS")
    p.add_argument("--time", "-t", help="time limit per job, e.g. 24:00:00")
    p.add_argument("--job-name", help="job name (default kvtrain-<run folder>-<hash of its "
                   "path>); jobs of one name run one at a time (--dependency=singleton)")
    p.add_argument("--signal-seconds", type=int, default=300,
                   help="send SIGUSR1 this many seconds before the time limit: the trainer "
                        "saves and the job requeues itself (default 300)")
    p.add_argument("--chain", type=int, default=1,
                   help="submit this many jobs in a chain (default 1)")
    p.add_argument("--no-singleton", action="store_true",
                   help="do not add --dependency=singleton (refused with --chain)")
    p.add_argument("--max-requeues", type=int, default=None,
                   help="requeue at most this many times (default 50)")
    p.add_argument("--container-image", help="run in this container (pyxis/enroot)")
    p.add_argument("--container-mounts", help="more pyxis --container-mounts (the repo, the run "
                   "folder and its checkpoint and log folders are mounted unless these cover them)")
    p.add_argument("--run-dir", help="run folder (default: the config's, else runs/<name>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra sbatch argument, e.g. --sbatch-arg=--exclude=node7 (repeatable)")
    p.add_argument("--no-plan", action="store_true",
                   help="skip the memory estimate of kvtrain plan (GPU jobs)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch commands only")
    p.set_defaults(func=run)


def repo_root() -> Path:
    """The checkout holding launch/slurm.sbatch (kvtrain is installed editable)."""
    here = Path(__file__).resolve().parents[2]
    if (here / "launch" / "slurm.sbatch").is_file():
        return here
    cwd = Path.cwd()
    if (cwd / "launch" / "slurm.sbatch").is_file():
        return cwd
    raise SystemExit("kvtrain submit: launch/slurm.sbatch not found (run from the kvtrain checkout)")


TIME_FORMS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"


def slurm_seconds(text: str) -> int | None:
    """Seconds of a SLURM time limit (``sbatch --time``), None for no limit
    (0, -1, UNLIMITED, INFINITE); a ConfigError when it is none of SLURM's forms.
    As in SLURM (parse_time.c) the fields are not range-checked: 99:99:99 is
    362439 s, and "D-" is D days."""
    from kvtrain.config import ConfigError

    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "-1"):
        return None
    form = text + "0" if text.endswith("-") else text  # "D-" is "D-0"
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", form)
    if m is None:
        raise ConfigError(f"--time {text!r} is not a SLURM time limit ({TIME_FORMS})")
    days, first, second, third = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0)
    elif third is not None:  # HH:MM:SS
        seconds = first * 3600 + second * 60 + third
    else:  # MM[:SS]
        seconds = first * 60 + (second or 0)
    return seconds or None


NO_LIMIT = ("UNLIMITED", "INFINITE")


def check_time(time: str | None, signal_seconds: int) -> None:
    """A limit SLURM reads as none (0, -1) is refused: it looks like a short job.
    The stop signal must come after the start: at or before it, every job
    would save and requeue at once, over and over (up to --max-requeues)."""
    from kvtrain.config import ConfigError

    if time is None:
        return
    text = time.strip()
    no_limit = "SLURM reads it as no time limit: leave --time out for the partition's default"
    if text.startswith("-"):
        raise ConfigError(f"--time {time!r} is negative: "
                          f"{no_limit if text == '-1' else 'a time limit is ' + TIME_FORMS}")
    limit = slurm_seconds(text)
    if limit is None and text.upper() not in NO_LIMIT:
        raise ConfigError(f"--time {time!r} is zero: {no_limit}")
    if limit is not None and signal_seconds >= limit:
        raise ConfigError(
            f"--signal-seconds {signal_seconds} is not shorter than --time {time} ({limit} s): "
            "every job would be told to stop as it starts (lower --signal-seconds or raise "
            "--time)")


TEXT_OPTIONS = ("job_name", "partition", "account", "qos", "time", "container_image",
                "container_mounts", "run_dir")


def check_text(args) -> None:
    """An empty --job-name, --partition ... was dropped as if not given: the job
    went out under the default without a word."""
    from kvtrain.config import ConfigError

    given = [("--" + dest.replace("_", "-"), getattr(args, dest)) for dest in TEXT_OPTIONS]
    for option, value in given + [("--sbatch-arg", arg) for arg in args.sbatch_arg]:
        if value is not None and not value.strip():
            raise ConfigError(f"{option} {value!r} is empty (leave it out for the default)")


def job_name(run_dir: Path) -> str:
    """``kvtrain-<run folder>-<hash of its path>``: --dependency=singleton serialises
    the jobs of one name, which must be those of one run folder (a chain, a second
    submit that continues it), not a sweep of one config into several folders."""
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:6]
    return f"kvtrain-{run_dir.name}-{digest}"


def check_folders(folders: dict[str, Path]) -> None:
    """A file where the run's folder would be (a typo in --run-dir): one line
    here, not a job that fails on the cluster after waiting in the queue."""
    from data_tools.fileio import not_a_folder
    from kvtrain.config import ConfigError

    for key, folder in folders.items():
        if why := not_a_folder(folder):
            raise ConfigError(f"{key} {why}")


def check_options(args) -> None:
    """Counts, names and the time limit, in one line each before anything is read."""
    from kvtrain.config import ConfigError

    if args.nodes < 1 or args.chain < 1 or args.gpus_per_node < 0:
        raise ConfigError("--nodes and --chain must be >= 1 and --gpus-per-node >= 0")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:  # 0 silently meant the default
        raise ConfigError(f"--nproc-per-node must be >= 1 (leave it out for the default), "
                          f"got {args.nproc_per_node}")
    if args.max_requeues is not None and args.max_requeues < 0:  # went to slurm.sbatch as it was
        raise ConfigError(f"--max-requeues must be >= 0, got {args.max_requeues}")
    if args.signal_seconds < 1:  # 0: the signal with the kill, no time to save
        raise ConfigError("--signal-seconds must be >= 1 (the seconds the trainer has to save "
                          f"before the time limit), got {args.signal_seconds}")
    if args.chain > 1 and args.no_singleton:
        raise ConfigError(f"--chain {args.chain} with --no-singleton: the {args.chain} jobs would "
                          "start at once on one run folder (--dependency=singleton runs them "
                          "one after another)")
    check_text(args)
    if args.container_mounts and not args.container_image:  # slurm.sbatch would drop them
        raise ConfigError(f"--container-mounts {args.container_mounts}: mounts are a "
                          "container's (give --container-image)")
    check_time(args.time, args.signal_seconds)


def build(args) -> tuple[list[str], dict[str, str]]:
    """The sbatch command line and the environment it needs (also for tests)."""
    from kvtrain.config import ConfigError, checkpoint_folder, load_config, run_folder

    check_options(args)
    nproc = args.nproc_per_node or (args.gpus_per_node or None)
    world = args.nodes * nproc if nproc else None
    cfg = load_config(args.config, args.overrides, world_size=world)
    if args.gpus_per_node > 0 and not args.no_plan:
        from kvtrain.plan import PlanError, make_plan

        try:
            make_plan(cfg, nodes=args.nodes, gpus_per_node=nproc, gpu=args.gpu)
        except PlanError as e:
            raise ConfigError(f"kvtrain plan refuses this layout: {e}") from None

    repo = repo_root()
    run_dir = run_folder(cfg, args.run_dir)
    run_dir = (run_dir if run_dir.is_absolute() else Path.cwd() / run_dir).resolve()
    checkpoints = checkpoint_folder(cfg.checkpoint.dir, run_dir)
    check_folders({"--run-dir" if args.run_dir else "run_dir": run_dir,
                   "checkpoint.dir": checkpoints})
    config = Path(args.config).resolve()
    name = args.job_name or job_name(run_dir)

    cmd = ["sbatch", "--parsable", f"--job-name={name}", f"--nodes={args.nodes}",
           "--ntasks-per-node=1", f"--chdir={repo}",
           f"--output={run_dir / 'logs' / 'slurm-%j.out'}",
           f"--signal=B:USR1@{args.signal_seconds}", "--requeue"]
    if args.gpus_per_node > 0:
        cmd.append(f"--gpus-per-node={args.gpus_per_node}")
    for flag in ("partition", "account", "qos", "time"):
        value = getattr(args, flag)
        if value:
            cmd.append(f"--{flag}={value}")
    if not args.no_singleton:
        cmd.append("--dependency=singleton")
    cmd += args.sbatch_arg
    cmd += [str(repo / "launch" / "slurm.sbatch"), str(config), *args.overrides]

    # the checkpoint folder for a container job, whose start cannot resolve it
    env = {"RUN_DIR": str(run_dir), "KVTRAIN_REPO": str(repo),
           "CHECKPOINT_DIR": str(checkpoints)}
    # sbatch passes the submitting shell's environment on, where the scripts read
    # these: each is this command's (empty: the scripts' default), not a leftover
    # of the shell that contradicts the layout checked here or the logs it names
    env |= {"NPROC_PER_NODE": str(nproc or ""), "LOG_DIR": "", "KVTRAIN_DRY_RUN": "",
            "MAX_REQUEUES": "" if args.max_requeues is None else str(args.max_requeues),
            "CONTAINER_IMAGE": args.container_image or "",
            "CONTAINER_MOUNTS": args.container_mounts or ""}
    return cmd, env


def run(args) -> int:
    cmd, env = build(args)
    # every variable sbatch is given, the blank ones too (they override the shell's)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)
    if args.dry_run:
        for _ in range(args.chain):
            print(shown)
        return 0
    if shutil.which("sbatch") is None:
        print("kvtrain submit: sbatch not found (is this a SLURM login node?)", file=sys.stderr)
        return 1
    logs = Path(env["RUN_DIR"], "logs")
    try:
        made = make_folders(logs)
    except OSError as e:  # read-only, or a place no folder can be made (/proc)
        print(f"kvtrain submit: cannot make the log folder {logs}: {e.strerror}", file=sys.stderr)
        return 1
    jobs: list[str] = []
    try:
        return submit_chain(cmd, env, args.chain, jobs)
    finally:  # nothing queued (sbatch refused, or did not start): no folder of ours is left
        if not jobs:
            remove_empty(made)


def make_folders(folder: Path) -> list[Path]:
    """``mkdir -p folder``; the folders it made, deepest first (a failure removes them)."""
    missing = list(takewhile(lambda f: not f.exists(), (folder, *folder.parents)))
    made: list[Path] = []
    try:
        for new in reversed(missing):
            try:
                new.mkdir()
            except FileExistsError:  # made meanwhile, by someone else: not ours
                continue
            made.insert(0, new)
    except OSError:
        remove_empty(made)
        raise
    return made


def remove_empty(made: list[Path]) -> None:
    """Removes the folders ``make_folders`` made, deepest first, while they are empty."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # something is in it now: it and those above it stay
            return


def submit_chain(cmd: list[str], env: dict[str, str], chain: int, jobs: list[str]) -> int:
    """Calls sbatch ``chain`` times, adding each job id to ``jobs``."""
    for _ in range(chain):
        try:
            out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        except OSError as e:  # sbatch found but not startable (its interpreter is missing)
            print(f"kvtrain submit: cannot run sbatch: {e.strerror}", file=sys.stderr)
            return 1
        if out.returncode != 0:
            msg = (out.stderr or out.stdout).strip().splitlines()
            # the jobs already queued will train: say which
            queued = (f" (job {len(jobs) + 1} of the chain of {chain}; submitted and "
                      f"queued: {' '.join(jobs)})") if jobs else ""
            print(f"kvtrain submit: sbatch failed: {msg[-1] if msg else out.returncode}{queued}",
                  file=sys.stderr)
            return 1
        jobs.append(out.stdout.strip().split(";")[0])
    print(f"submitted job{'s' if len(jobs) > 1 else ''} {' '.join(jobs)}: run folder "
          f"{env['RUN_DIR']}, logs {env['RUN_DIR']}/logs/slurm-<job id>")
    return 0
