"""``kvtrain demo``: the research loop, small and real, on the CPU in a few minutes.

1. Data (into ``runs/demo/data``, reused when already there): with the data
   tools, a corpus of the Python standard library's docstrings
   (``kvtrain data demo-corpus``), a sentencepiece BPE tokenizer trained on it
   (``train-tokenizer``) and megatron ``.bin/.idx`` shards (``preprocess``).
   Without them, a synthetic structured token corpus (kvtrain.data.synthetic).
2. Two arms of ``configs/demo.yaml`` (a 4-layer model) on that data, same
   seed, differing in ``model.attention`` only: ``runs/demo/vanilla`` and
   ``runs/demo/kv_shift``, each a ``kvtrain train`` process (the command
   printed, for rerunning by hand), side by side on a machine with the cores
   for it (``--workers``), with validation, KV-shift statistics, checkpoints,
   metrics.jsonl and an offline wandb run; ``--nproc N`` ranks per arm under
   torchrun.
3. ``kvtrain compare runs/demo/vanilla runs/demo/kv_shift --out
   runs/demo/compare``: the report, its plots and the printed comparison.

A rerun continues each arm where it stopped (``checkpoint.resume: auto``); a
finished demo only prints its comparison again. ``--fresh`` starts the arms
over (the data is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from kvtrain.config import ConfigError

DEMO_VOCAB = 2048


ARMS = ("vanilla", "kv_shift")  # the reference first: kvtrain compare's A


def register(sub) -> None:
    p = sub.add_parser("demo", help="the research loop on the CPU: data -> vanilla and KV shift "
                                    "side by side -> comparison")
    p.add_argument("--run-dir", default="runs/demo", metavar="DIR",
                   help="demo folder (default runs/demo): DIR/data, DIR/vanilla, DIR/kv_shift, "
                        "DIR/compare")
    p.add_argument("--config", default=None, metavar="YAML", help="default: configs/demo.yaml")
    p.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) per arm")
    p.add_argument("--workers", type=int, default=None,
                   help="arms trained side by side (default: 2 when the machine has a core per "
                        "rank of both arms, else 1)")
    p.add_argument("--steps", type=int, default=None, help="override train.max_steps")
    p.add_argument("--fresh", action="store_true",
                   help="start both arms over (default: continue them; a finished demo only "
                        "prints its comparison again)")
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument("--synthetic", action="store_true",
                   help="use the synthetic corpus even when the data tools are available")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides (both arms)")
    p.set_defaults(func=run)


def default_config() -> Path:
    return Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def _data_tools_available() -> bool:
    try:
        from data_tools import cli  # noqa: F401

        return all(c in cli.COMMANDS for c in ("demo-corpus", "train-tokenizer", "preprocess"))
    except Exception:
        return False


class DataStepError(ConfigError):
    """A data tool the demo ran failed; the tool printed its own line first."""

    kind = "data error"


def _tool(data_dir: Path, *argv: str) -> None:
    print("+ kvtrain data " + " ".join(argv), flush=True)
    code = subprocess.run([sys.executable, "-m", "data_tools", *argv]).returncode
    if code != 0:  # the tool said why; a CalledProcessError traceback only hid it
        raise DataStepError(f"kvtrain data {argv[0]} failed (exit {code}, its error is above): "
                            f"fix or remove what it reads in {data_dir} and rerun")


def prepare_data(data_dir: Path, synthetic: bool = False) -> list[str]:
    """Builds (or reuses) the demo data; returns config overrides pointing at it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if not synthetic and _data_tools_available():
        corpus = data_dir / "corpus.jsonl"
        tokenizer = data_dir / "tokenizer"
        shards = data_dir / "shards"
        # each made only where it is missing, whatever a killed build left of it
        # replaced (--force: the tools refuse outputs that exist, and this is the demo's)
        if not corpus.exists():
            _tool(data_dir, "demo-corpus", "--output", str(corpus), "--force")
        if not tokenizer.with_suffix(".model").exists():
            _tool(data_dir, "train-tokenizer", "--input", str(corpus), "--vocab-size",
                  str(DEMO_VOCAB), "--output", str(tokenizer), "--force")
        if not list(shards.glob("*.idx")):
            _tool(data_dir, "preprocess", "--input", str(corpus), "--tokenizer",
                  str(tokenizer.with_suffix(".model")), "--output-prefix", str(shards / "demo"),
                  "--quiet", "--force")
        prefixes = sorted(str(p.with_suffix("")) for p in shards.glob("*.idx"))
        # JSON is YAML: quoted, a comma, bracket or ' #' in --run-dir stays in the path
        return [f"data.paths={json.dumps(prefixes)}",
                f"data.tokenizer={json.dumps(str(tokenizer.with_suffix('.model')))}"]
    from kvtrain.data.synthetic import write_synthetic_corpus

    prefix = data_dir / "synthetic" / "corpus"
    if not Path(str(prefix) + ".idx").exists():
        print("kvtrain demo: data tools not available, writing a synthetic corpus", flush=True)
        write_synthetic_corpus(prefix, num_docs=3000, vocab_size=DEMO_VOCAB, seed=0)
    return [f"data.paths={json.dumps([str(prefix)])}", "data.tokenizer=null",
            f"data.eod_id={DEMO_VOCAB - 1}"]


# What a run writes into its folder (the demo's data/ is kept and reused), and eval/:
# kvtrain eval's and perplexity's results of its checkpoints, which kvtrain compare
# would show beside the fresh arms' curves as theirs (and the export cached for them).
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "checkpoints", "wandb", "wandb_run_id",
               "data_cache", "eval")


def _clear_run(run_dir: Path) -> None:
    """Removes a previous demo run's outputs, and nothing else."""
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def summarize(run_dir: Path) -> str:
    """One arm's run in a few lines: loss from start to end, validation, speed."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    # the run's own validation (a named set of data.valid_sets has its own records)
    valid = [r for r in records if r.get("kind") == "valid" and not r.get("set")]
    lines = [f"[{run_dir.name}] {run_dir}"]
    if train:
        speed = sorted(r["tokens_per_s"] for r in train)[len(train) // 2]
        lines.append(f"  train loss {train[0]['lm_loss']:.3f} (iter {train[0]['iteration']}) -> "
                     f"{train[-1]['lm_loss']:.3f} (iter {train[-1]['iteration']}), "
                     f"{train[-1]['consumed_tokens']:,} tokens, median {speed:,.0f} tokens/s")
    if valid:
        lines.append(f"  validation loss {valid[-1]['val_loss']:.3f} "
                     f"(perplexity {valid[-1]['val_ppl']:.1f}) at iter {valid[-1]['iteration']}")
    return "\n".join(lines)


# what each arm sets (arm_command), and its checkpoints, in its own folder (--fresh clears it)
ARM_KEYS = ("model.attention", "name", "wandb.group", "run_dir", "checkpoint.dir")


def arm_command(config: Path, run_dir: Path, arm: str, overrides: list[str],
                nproc: int) -> list[str]:
    """``kvtrain train CONFIG --run-dir DIR --set ...`` of one arm (torchrun for nproc > 1)."""
    if nproc > 1:
        from kvtrain.backend import free_port

        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    f"--master-port={free_port()}", "-m", "kvtrain.cli"]
    else:
        launcher = [sys.executable, "-m", "kvtrain.cli"]
    sets = overrides + [f"model.attention={arm}", f"name=demo-{arm}", "wandb.group=demo"]
    return launcher + ["train", str(config), "--run-dir", str(run_dir / arm)] + \
        [x for o in sets for x in ("--set", o)]


def _pump(arm: str, stream, lock: threading.Lock) -> None:
    """Prints an arm's output line by line, each line tagged with the arm."""
    for line in stream:
        with lock:
            print(f"[{arm:>8}] {line.rstrip()}", flush=True)


def train_arms(commands: dict[str, list[str]], workers: int, threads: int) -> dict[str, int]:
    """Runs the arms' commands, ``workers`` at a time; their exit codes. Stopped
    (Ctrl-C, SIGTERM), it stops the running arms at a step with a checkpoint and
    raises the stop; killed, its arms stop by themselves (``children``)."""
    from kvtrain.experiments.children import run_all, start_run

    env = dict(os.environ)  # less an enclosing launcher's variables (start_run)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")  # lines as they come
    pumps, codes = {}, {}
    lock = threading.Lock()

    def start(arm: str) -> subprocess.Popen:
        print("+ " + shlex.join(commands[arm]), flush=True)  # to rerun by hand
        proc = start_run(commands[arm], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace")
        # its output read from the start: a full pipe would stall it
        pumps[arm] = threading.Thread(target=_pump, args=(arm, proc.stdout, lock), daemon=True)
        pumps[arm].start()
        return proc

    def finish(arm: str, proc: subprocess.Popen) -> None:
        pumps.pop(arm).join()  # its last lines first
        codes[arm] = proc.returncode

    run_all(list(commands), start, finish, workers,
            lambda _: "kvtrain demo: stopped; the same command continues the arms from their "
                      "checkpoints")
    return codes


def finished_at(config: Path, run_dir: Path, arm: str, overrides: list[str],
                nproc: int) -> Optional[int]:
    """The iteration of the arm's latest checkpoint when it has reached the arm's
    total steps (a rerun then has nothing to train), else None. Loads the arm's
    config (no torch): a bad ``--set`` is one line before anything runs."""
    from kvtrain.config import checkpoint_folder, load_config
    from kvtrain.config.layout import total_steps
    from kvtrain.train.integrity import iteration_of, read_tracker

    cfg = load_config(config, overrides + [f"model.attention={arm}"], world_size=nproc)
    latest, _ = read_tracker(checkpoint_folder(cfg.checkpoint.dir, run_dir / arm))
    done = iteration_of(latest) if latest is not None else None
    # the trainer's count: train.max_steps may be null (a train.train_tokens budget)
    steps, _ = total_steps(cfg)
    return done if done is not None and done >= steps else None


def check_before_building(config: Path, run_dir: Path, overrides: list[str], nproc: int) -> None:
    """A bad --set or a --run-dir that cannot be made: one line before the data is
    built and before --fresh clears the arms (the data overrides come later:
    they only point at the data)."""
    from data_tools.fileio import not_a_folder
    from kvtrain.config import ConfigError, load_config, make_folder

    if why := not_a_folder(run_dir):
        raise ConfigError(f"--run-dir {why}")
    from kvtrain.experiments.presets import owned_key

    for assignment in overrides:  # what arm_command sets after them would win, unsaid
        if owned_key(assignment, ARM_KEYS) is not None:
            key = assignment.partition("=")[0].strip()
            raise ConfigError(f"--set {key}: the demo sets it for each arm ({', '.join(ARMS)}); "
                              "train one config with kvtrain train")
    for arm in ARMS:
        load_config(config, overrides + [f"model.attention={arm}"], world_size=nproc)
    make_folder(run_dir, "--run-dir")


def _workers(requested: Optional[int], nproc: int) -> int:
    if requested is not None:
        return max(1, min(requested, len(ARMS)))
    return len(ARMS) if (os.cpu_count() or 1) >= len(ARMS) * nproc else 1


def run(args) -> int:
    started = time.monotonic()
    run_dir = Path(args.run_dir)
    config = Path(args.config) if args.config else default_config()
    if not config.exists():
        print(f"kvtrain demo: config {config} not found (use --config)", file=sys.stderr)
        return 2
    user = ([f"train.max_steps={args.steps}"] if args.steps is not None else []) + args.overrides
    if (args.workers is not None and args.workers < 1) or args.nproc < 1:  # 0, -1: taken as 1
        raise ConfigError(f"--workers and --nproc must be at least 1, got {args.workers} and "
                          f"{args.nproc}")
    check_before_building(config, run_dir, user, args.nproc)
    overrides = prepare_data(run_dir / "data", args.synthetic) + user
    if args.fresh:
        for arm in ARMS:
            _clear_run(run_dir / arm)
    commands = {}
    for arm in ARMS:
        done = finished_at(config, run_dir, arm, overrides, args.nproc)
        if done is None:
            commands[arm] = arm_command(config, run_dir, arm, overrides, args.nproc)
        else:
            print(f"[{arm:>8}] already trained to iteration {done} ({run_dir / arm}; "
                  f"--fresh starts over)", flush=True)
    workers = min(_workers(args.workers, args.nproc), max(1, len(commands)))
    threads = max(1, (os.cpu_count() or 1) // (workers * args.nproc))
    codes = {arm: 0 for arm in ARMS if arm not in commands}
    codes.update(train_arms(commands, workers, threads))
    failed = [arm for arm in ARMS if codes.get(arm) != 0]
    if failed:
        if len(failed) > 1:
            exits = ", ".join(f"{a} exit {codes.get(a)}" for a in failed)
            who, whose = "both arms", "their"
        else:
            exits = f"exit {codes.get(failed[0])}"
            who, whose = f"the {failed[0]} arm", "its"
        print(f"kvtrain demo: {who} failed ({exits}); {whose} output is above "
              f"(kvtrain demo --fresh starts the arms over)", file=sys.stderr)
        return 1
    from kvtrain.analysis.compare import compare

    _, text = compare([run_dir / arm for arm in ARMS], run_dir / "compare")
    for arm in ARMS:
        print(summarize(run_dir / arm), flush=True)
    print(text, flush=True)
    print(f"kvtrain demo: done in {time.monotonic() - started:.0f} s; comparison plot: "
          f"{run_dir / 'compare' / 'loss.png'}", flush=True)
    return 0
