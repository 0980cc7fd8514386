"""``kvtrain demo``: a small, real, end-to-end job on the CPU in a few minutes.

1. Data (into ``runs/demo/data``, reused when already there): with the data
   tools, a corpus of the Python standard library's docstrings
   (``kvtrain data demo-corpus``), a sentencepiece BPE tokenizer trained on it
   (``train-tokenizer``) and megatron ``.bin/.idx`` shards (``preprocess``).
   Without them, a synthetic structured token corpus (kvtrain.data.synthetic).
2. Training: ``configs/demo.yaml`` (a 4-layer KV-shift model) on those shards,
   with validation, KV-shift statistics, checkpoints, metrics.jsonl and an
   offline wandb run in ``runs/demo``; one process, or ``--nproc N`` ranks
   under torchrun.
3. A summary: loss at the start and the end, validation loss, throughput.

Every run starts fresh (the run folder is cleared, the data kept) unless
``--resume`` is given.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEMO_VOCAB = 2048


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the end-to-end CPU demo (data -> tokenizer -> training)")
    p.add_argument("--run-dir", default="runs/demo", metavar="DIR",
                   help="run folder (default runs/demo); data goes to DIR/data")
    p.add_argument("--config", default=None, metavar="YAML", help="default: configs/demo.yaml")
    p.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) for the training")
    p.add_argument("--steps", type=int, default=None, help="override train.max_steps")
    p.add_argument("--resume", action="store_true", help="continue the previous demo run")
    p.add_argument("--synthetic", action="store_true",
                   help="use the synthetic corpus even when the data tools are available")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides")
    p.set_defaults(func=run)


def default_config() -> Path:
    return Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def _data_tools_available() -> bool:
    try:
        from data_tools import cli  # noqa: F401

        return all(c in cli.COMMANDS for c in ("demo-corpus", "train-tokenizer", "preprocess"))
    except Exception:
        return False


def _tool(*argv: str) -> None:
    print("+ kvtrain data " + " ".join(argv), flush=True)
    subprocess.run([sys.executable, "-m", "data_tools", *argv], check=True)


def prepare_data(data_dir: Path, synthetic: bool = False) -> list[str]:
    """Builds (or reuses) the demo data; returns config overrides pointing at it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if not synthetic and _data_tools_available():
        corpus = data_dir / "corpus.jsonl"
        tokenizer = data_dir / "tokenizer"
        shards = data_dir / "shards"
        if not corpus.exists():
            _tool("demo-corpus", "--output", str(corpus))
        if not tokenizer.with_suffix(".model").exists():
            _tool("train-tokenizer", "--input", str(corpus), "--vocab-size", str(DEMO_VOCAB),
                  "--output", str(tokenizer))
        if not list(shards.glob("*.idx")):
            _tool("preprocess", "--input", str(corpus), "--tokenizer",
                  str(tokenizer.with_suffix(".model")), "--output-prefix", str(shards / "demo"),
                  "--quiet")
        prefixes = sorted(str(p.with_suffix("")) for p in shards.glob("*.idx"))
        return [f"data.paths=[{', '.join(prefixes)}]",
                f"data.tokenizer={tokenizer.with_suffix('.model')}"]
    from kvtrain.data.synthetic import write_synthetic_corpus

    prefix = data_dir / "synthetic" / "corpus"
    if not Path(str(prefix) + ".idx").exists():
        print("kvtrain demo: data tools not available, writing a synthetic corpus", flush=True)
        write_synthetic_corpus(prefix, num_docs=3000, vocab_size=DEMO_VOCAB, seed=0)
    return [f"data.paths=[{prefix}]", "data.tokenizer=null", f"data.eod_id={DEMO_VOCAB - 1}"]


# What a run writes into its folder (the demo's data/ is kept and reused).
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "checkpoints", "wandb", "wandb_run_id",
               "data_cache")


def _clear_run(run_dir: Path) -> None:
    """Removes a previous demo run's outputs, and nothing else."""
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def summarize(run_dir: Path, seconds: float) -> str:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    valid = [r for r in records if r.get("kind") == "valid"]
    kv = [r for r in records if r.get("kind") == "kv_shift"]
    lines = [f"kvtrain demo: done in {seconds:.0f} s; run folder {run_dir}"]
    if train:
        speed = sorted(r["tokens_per_s"] for r in train)[len(train) // 2]
        lines.append(f"  train loss {train[0]['lm_loss']:.3f} (iter {train[0]['iteration']}) -> "
                     f"{train[-1]['lm_loss']:.3f} (iter {train[-1]['iteration']}), "
                     f"{train[-1]['consumed_tokens']:,} tokens, median {speed:,.0f} tokens/s")
    if valid:
        lines.append(f"  validation loss {valid[-1]['val_loss']:.3f} "
                     f"(perplexity {valid[-1]['val_ppl']:.1f}) at iter {valid[-1]['iteration']}")
    if kv:
        quad = {k.rsplit('/', 1)[1]: v for k, v in kv[-1].items() if "/quadrant/" in k}
        if quad:
            lines.append(f"  KV-shift heads (Table 5 quadrants): {quad}")
    lines.append(f"  files: config.yaml, metrics.jsonl, checkpoints/, wandb/ in {run_dir}")
    return "\n".join(lines)


def run(args) -> int:
    started = time.monotonic()
    run_dir = Path(args.run_dir)
    config = Path(args.config) if args.config else default_config()
    if not config.exists():
        print(f"kvtrain demo: config {config} not found (use --config)", file=sys.stderr)
        return 2
    overrides = [f"run_dir={run_dir}"] + prepare_data(run_dir / "data", args.synthetic)
    if args.steps is not None:
        overrides.append(f"train.max_steps={args.steps}")
    overrides += args.overrides
    if args.resume:
        overrides.append("checkpoint.resume=auto")
    else:
        _clear_run(run_dir)
    if args.nproc > 1:
        from kvtrain.backend import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               f"--master-port={free_port()}", "-m", "kvtrain.cli", "train", str(config)]
        for o in overrides:
            cmd += ["--set", o]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        code = subprocess.run(cmd, env=env).returncode
    else:
        from kvtrain.commands.train import quiet_imports
        from kvtrain.config import load_config

        cfg = load_config(config, overrides, world_size=1)
        quiet_imports()
        from kvtrain.train import train

        code = train(cfg, run_dir)
    if code == 0 and (run_dir / "metrics.jsonl").exists():
        print(summarize(run_dir, time.monotonic() - started), flush=True)
    return code
