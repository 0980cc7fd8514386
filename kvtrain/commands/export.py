"""``kvtrain export hf RUN_DIR|CHECKPOINT OUT_DIR [--dtype fp32|bf16] [--force]``.

One CPU process: the checkpoint of any TP/PP/DP layout is loaded whole and
written as a Hugging Face folder (``kvtrain.hf.export``).
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint to another format (hf)",
                       description="Export a kvtrain checkpoint (any parallel layout).")
    formats = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    hf = formats.add_parser(
        "hf", help="a Hugging Face model folder",
        description="Vanilla runs give a stock LlamaForCausalLM folder; KV-shift runs give "
                    "Llama weights plus the shift coefficients and remote code "
                    "(AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)).")
    hf.add_argument("source", metavar="RUN_DIR|CHECKPOINT",
                    help="a run folder (its latest complete checkpoint) or one checkpoint")
    hf.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face folder to write")
    hf.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weight dtype")
    hf.add_argument("--force", action="store_true",
                    help="replace an earlier export (a Hugging Face model folder) at OUT_DIR")
    hf.set_defaults(func=run)


def run(args) -> int:
    from kvtrain.hf import require_hf

    require_hf()  # one line naming the extra, before torch and megatron are imported
    from kvtrain.commands.train import quiet_imports

    quiet_imports()
    from kvtrain.hf.export import export_hf

    out = export_hf(args.source, args.out_dir, dtype=args.dtype, force=args.force)
    print(f"kvtrain: exported {args.source} to {out}")
    return 0
