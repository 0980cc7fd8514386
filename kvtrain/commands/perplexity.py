"""``kvtrain perplexity RUN_DIR|CHECKPOINT --data SHARD [SHARD ...] [--name NAME]
[--sequences N] [--batch-size B] [--seq-length L] [--tokenizer MODEL] [--backend B]
[--by-position] [--checkpoints latest|all] [--dtype fp32|bf16] [--out FILE]
[--no-wandb]``.

A checkpoint's loss and perplexity on any shards after training: both arms of a
comparison scored on a corpus neither validated on, or at a longer context than
they were trained on. The shards are read as a named validation set of the run
reads them (``data.valid_sets``; ``kvtrain.inference.perplexity``). One process,
or ``torchrun --nproc-per-node N`` for tensor parallelism N (rank 0 prints and
writes). The result goes to ``RUN_DIR/eval/perplexity-NAME-iter_XXXXXXX-nN[-seqL]
[-bf16].json``, where ``kvtrain compare`` shows it beside the lm-eval results, and
to the run's wandb run as ``eval/perplexity/NAME/loss`` (a checkpoint outside any run
folder: only to ``--out``). Bad input is one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "perplexity", help="a checkpoint's loss and perplexity on shards (any corpus, any length)",
        description="Scores a kvtrain checkpoint on Megatron .bin/.idx shards: the mean "
                    "next-token loss over their first N sequences, read as a named "
                    "validation set of the run reads them (data.valid_sets).")
    p.add_argument("source", metavar="RUN_DIR|CHECKPOINT",
                   help="a run folder (its latest complete checkpoint) or one iter_* folder")
    p.add_argument("--data", nargs="+", required=True, metavar="SHARD",
                   help="shard prefixes in the forms of data.paths (weights too: 0.7 a 0.3 b)")
    p.add_argument("--name", default=None,
                   help="the set's name in the record (default: the first shard's name)")
    p.add_argument("--sequences", type=int, default=None, metavar="N",
                   help="sequences scored (default: the run's train.eval_iters x "
                        "global_batch_size)")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="sequences a forward pass (default: the run's train.micro_batch_size)")
    p.add_argument("--seq-length", type=int, default=None, metavar="L",
                   help="tokens a sequence (default: the run's train.seq_length)")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="sentencepiece model (default: the run's data.tokenizer)")
    p.add_argument("--by-position", action="store_true",
                   help="also the loss at each position in the context (in the document where "
                        "the run separated documents) and the in-context learning score")
    p.add_argument("--checkpoints", default="latest", choices=["latest", "all"],
                   help="latest (default): the run's latest complete checkpoint; all: every "
                        "complete checkpoint the run folder holds, oldest first (a held-out "
                        "curve along the training)")
    p.add_argument("--backend", default="auto", choices=["auto", "te", "torch", "local"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--out", default=None, metavar="FILE",
                   help="the result's JSON (default: RUN_DIR/eval/perplexity-...json)")
    p.add_argument("--no-wandb", action="store_true", help="do not log to the run's wandb run")
    p.set_defaults(func=run)


def _weighted(tokens: list[str]) -> list:
    """``--data 0.7 a 0.3 b``: numbers are the blend's weights (data.paths' form)."""
    out = []
    for token in tokens:
        try:
            out.append(float(token))
        except ValueError:
            out.append(token)
    return out


def _scoring(args: argparse.Namespace):
    from kvtrain.config.checks import check_blend
    from kvtrain.inference.perplexity import Scoring, default_name

    paths = _weighted(args.data)
    check_blend("--data", paths)
    # an empty --name is refused (Scoring.check), not the default taken in its place
    return Scoring(paths=paths, name=default_name(paths) if args.name is None else args.name,
                   sequences=args.sequences, batch_size=args.batch_size,
                   seq_length=args.seq_length, tokenizer=args.tokenizer,
                   by_position=args.by_position).check()


def _report(args: argparse.Namespace, loaded, scoring, result: dict) -> None:
    """Rank 0: the lines, the record (``--out``, else the run folder's ``eval/``; a
    checkpoint of no run folder: none) and the run's wandb run."""
    from data_tools.fileio import atomic_write_text
    from kvtrain.evaluate.report import log_to_wandb
    from kvtrain.evaluate.source import EVAL_DIR, run_folder_of
    from kvtrain.inference.perplexity import record_file, result_record

    print(f"kvtrain perplexity: {loaded.checkpoint} (iteration {loaded.iteration}, "
          f"{loaded.config.model.attention}, backend {loaded.backend}, {args.dtype}): "
          f"{scoring.name} loss {result['loss']:.4f} ppl {result['ppl']:.2f} over "
          f"{result['sequences']} sequences of {result['seq_length']} tokens "
          f"({result['tokens']} scored)", flush=True)
    if "by_position" in result:
        _print_positions(result["by_position"])
    run_dir = run_folder_of(Path(args.source).expanduser(), loaded.checkpoint)
    path = Path(args.out).expanduser() if args.out else None
    if path is None and run_dir is not None:
        path = run_dir / EVAL_DIR / record_file(scoring.name, loaded.iteration, result,
                                                loaded.config.train.seq_length, args.dtype)
    record = result_record(loaded, scoring, result, args.dtype)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(record, indent=1) + "\n")
        print(f"kvtrain perplexity: wrote {path}", flush=True)
    else:
        print(f"kvtrain perplexity: result not saved ({args.source} is in no kvtrain run "
              "folder: --out FILE)", flush=True)
    if run_dir is not None and not args.no_wandb:
        numbers = {task: {m: v for m, v in metrics.items() if v is not None}
                   for task, metrics in record["tasks"].items()}
        note = log_to_wandb(loaded.config, run_dir, loaded.iteration, numbers)
        print(f"kvtrain perplexity: {note}", flush=True)


def _print_positions(by: dict) -> None:
    from kvtrain.analysis.positions import binned
    from kvtrain.inference.perplexity import fmt

    bins = "  ".join(f"{a}-{b} {fmt(m)}" if a != b else f"{a} {fmt(m)}"
                     for a, b, m in binned(by["loss"], by["tokens"]))
    print(f"kvtrain perplexity: loss by tokens of context (in the {by['context']}): {bins}",
          flush=True)
    score = by["icl_score"]
    print("kvtrain perplexity: in-context learning score (loss at 500 tokens of context - at "
          f"50): {fmt(score) if score is not None else 'needs sequences of 500 tokens or more'}",
          flush=True)


def run(args: argparse.Namespace) -> int:
    from kvtrain.commands.train import quiet_imports

    quiet_imports()  # megatron's import-time lines about GPU libraries a CPU lacks
    # What a user can get wrong in the flags is checked before torch/megatron are imported.
    from kvtrain.commands.generate import check_out, load_on_every_rank
    from kvtrain.config import ConfigError

    scoring = _scoring(args)
    if args.out and args.checkpoints == "all":
        raise ConfigError("--out names one file: with --checkpoints all each checkpoint's "
                          "record goes to RUN_DIR/eval/ (its iteration in its name)")
    check_out(args.out)
    import torch

    from kvtrain.inference.perplexity import score

    from kvtrain.inference.loading import every_checkpoint

    sources = [args.source] if args.checkpoints == "latest" else every_checkpoint(args.source)
    for source in sources:
        loaded = load_on_every_rank(str(source), args.backend, args.dtype)
        result = score(loaded, scoring)
        if torch.distributed.get_rank() == 0:
            _report(args, loaded, scoring, result)
    sys.stdout.flush()
    return 0
