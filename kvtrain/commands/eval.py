"""``kvtrain eval RUN_DIR|CHECKPOINT|HF_DIR --tasks T1,T2 [--num-fewshot K]
[--limit N] [--include-path DIR] [--batch-size B] [--device cpu|cuda] [--dtype]
[--trust-remote-code]``.

Benchmarks a model through lm-evaluation-harness, offline. A run folder or a
checkpoint is exported to a Hugging Face folder first (cached under
``RUN_DIR/eval/``); results go to ``RUN_DIR/eval/<tasks>-iter_XXXXXXX.json``
(``-Kshot`` / ``-limitN`` / ``-bf16`` added when given),
the run's wandb run and a printed table. An HF folder is evaluated as it is
(results printed, and written to ``--out FILE``), and so is a checkpoint
outside any run folder (exported to a temporary folder).
"""

from __future__ import annotations

import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="benchmark a run, checkpoint or HF folder with lm-eval (offline)",
        description="Evaluates a kvtrain run / checkpoint (exported to Hugging Face format) or "
                    "a Hugging Face folder on lm-eval tasks, from local files only: lm-eval's "
                    "tasks whose datasets are in the local datasets cache, or task YAMLs in "
                    "--include-path reading local json/csv files. Never downloads.",
    )
    p.add_argument("source", metavar="RUN_DIR|CHECKPOINT|HF_DIR")
    p.add_argument("--tasks", required=True, metavar="T1,T2",
                   help="lm-eval task, group or tag names, comma separated")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                   help="few-shot examples (default: each task's own, else 0)")
    p.add_argument("--limit", type=float, default=None, metavar="N",
                   help="examples per task (below 1: a fraction); for quick checks")
    p.add_argument("--include-path", default=None, metavar="DIR",
                   help="folder of extra task YAMLs (local datasets)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="weights of the export and of the evaluated model (default fp32)")
    p.add_argument("--bootstrap-iters", type=int, default=1000, metavar="N",
                   help="bootstrap resamples for the stderr of non-mean metrics (0: none)")
    p.add_argument("--max-length", type=int, default=None, metavar="L",
                   help="tokens of context + continuation scored at most (default: a kvtrain "
                        "run's train.seq_length, the context it trained on; another folder's "
                        "max_position_embeddings)")
    p.add_argument("--log-samples", action="store_true",
                   help="also write every request's log-likelihoods (<record>.samples.jsonl)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="results JSON (default: RUN_DIR/eval/<tasks>-iter_XXXXXXX"
                        "[-Kshot][-limitN][-bf16].json)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the code an HF folder's config.json names (auto_map) when kvtrain "
                        "did not export the folder (kvtrain's own exports need no flag)")
    p.add_argument("--no-wandb", action="store_true", help="do not log to the run's wandb run")
    p.set_defaults(func=run)


def _spec(args):
    from kvtrain.config import ConfigError, one_process_only
    from kvtrain.evaluate.harness import EvalSpec

    one_process_only("kvtrain eval")  # every rank would export and evaluate
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError(f"--tasks {args.tasks!r}: no task names")
    if args.limit is not None and not 0 < args.limit < float("inf"):  # nan too
        raise ConfigError(f"--limit {args.limit}: must be positive (a count of examples, or "
                          f"a fraction of each task below 1)")
    if args.limit is not None and args.limit > 1 and args.limit != int(args.limit):
        raise ConfigError(f"--limit {args.limit:g}: a count of examples is a whole number "
                          "(below 1: a fraction of each task)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {args.num_fewshot}: must be 0 or more")
    if args.bootstrap_iters < 0:  # lm-eval takes it for 0 without a word
        raise ConfigError(f"--bootstrap-iters {args.bootstrap_iters}: must be 0 or more")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: must be at least 1")
    if args.max_length is not None and args.max_length < 1:
        raise ConfigError(f"--max-length {args.max_length}: must be at least 1")
    if args.device == "cuda" and _default_device() != "cuda":  # lm-eval's traceback, later
        raise ConfigError("--device cuda: no CUDA device here (torch.cuda.is_available() is "
                          "False); use --device cpu")
    out = Path(args.out).expanduser() if args.out else None
    if out is not None and out.is_dir():  # found only when writing, after the whole eval
        raise ConfigError(f"--out {args.out}: is a folder; name the results file, e.g. "
                          f"{out / 'results.json'}")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    include = Path(args.include_path).expanduser() if args.include_path else None
    if include is not None and not include.is_dir():
        raise ConfigError(f"--include-path {include}: no such folder")
    return EvalSpec(tasks=tasks, num_fewshot=args.num_fewshot, limit=limit,
                    include_path=include, batch_size=args.batch_size,
                    device=args.device or _default_device(), dtype=args.dtype,
                    bootstrap_iters=args.bootstrap_iters, log_samples=args.log_samples,
                    trust_remote_code=args.trust_remote_code, max_length=args.max_length)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args) -> int:
    from kvtrain.commands.train import quiet_imports
    from kvtrain.evaluate.harness import (
        check_fewshot, import_harness, load_tasks, run_harness, trusts_remote_code,
    )
    from kvtrain.evaluate.documents import check_documents
    from kvtrain.evaluate.report import (
        EVAL_DIR, log_to_wandb, make_record, record_name, render_table, write_record,
    )
    from kvtrain.commands.generate import check_out
    from kvtrain.config import ConfigError
    from kvtrain.config.loader import first_line
    from kvtrain.evaluate.source import is_hf_folder, prepared, window_of

    spec = _spec(args)
    check_out(args.out)  # a file in its path: one line now, not after the evaluation
    source = Path(args.source).expanduser()
    if not source.exists():  # a typo: now, not after lm-eval indexed its tasks (seconds)
        raise ConfigError(f"{source}: no such run folder, checkpoint or Hugging Face folder")
    quiet_imports()  # the export of a run loads megatron and its checkpoint
    import_harness()  # the extra, before any export; the offline switches, before any HF import
    if is_hf_folder(source):  # folder code refused: before the tasks
        trusts_remote_code(source, spec.trust_remote_code)
    # unknown task, missing dataset: one line, before any export or model
    loaded = load_tasks(spec.tasks, spec.include_path)
    check_fewshot(loaded[1], spec.num_fewshot)  # more shots than examples: before the export
    check_documents(loaded[1], spec.limit)  # a label outside the choices, a missing field
    with prepared(args.source, spec.dtype) as src:
        target = Path(args.out).expanduser() if args.out else None
        if target is None and src.run_dir is not None:
            name = record_name(spec.tasks, src.iteration, spec.num_fewshot, spec.limit,
                               spec.dtype, spec.max_length)
            target = src.run_dir / EVAL_DIR / name
        out = run_harness(src.hf_dir, spec, loaded)
        record = make_record(args.source, src.checkpoint, src.iteration,
                             None if src.temporary else src.hf_dir, spec, out)
        print(render_table(out.tasks, out.n_samples))
        print(f"kvtrain eval: scored within {out.max_length} tokens "
              f"({window_of(src.hf_dir, spec.max_length)[1]})")
        if target is not None:
            try:
                written = write_record(target, record, out.samples)
            except OSError as e:  # e.g. a file system that takes no file: the table stays
                raise ConfigError(f"cannot write the results to {target} (they are in the "
                                  f"table above): {first_line(e)}") from None
            for path in written:
                print(f"kvtrain eval: wrote {path}")
        else:
            why = ("is an HF folder, no kvtrain checkpoint" if src.checkpoint is None
                   else "is in no kvtrain run folder")  # an export in a run's eval/ too
            print(f"kvtrain eval: results not saved ({args.source} {why}: --out FILE)")
        if src.run_dir is not None and src.config is not None and not args.no_wandb:
            note = log_to_wandb(src.config, src.run_dir, src.iteration, out.tasks)
            print(f"kvtrain eval: {note}")
    sys.stdout.flush()
    return 0
