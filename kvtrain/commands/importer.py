"""``kvtrain import hf HF_DIR OUT_CHECKPOINT [--config RUN.yaml] [--set KEY=VALUE ...]``.

A Llama folder (stock, or a kvtrain KV-shift export) becomes a weights-only
kvtrain checkpoint; a run starts from it with ``checkpoint.resume: OUT_CHECKPOINT``
and ``checkpoint.load_optimizer: false`` (``kvtrain.hf.importer``).
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("import", help="import a model from another format (hf)",
                       description="Import a model as a kvtrain checkpoint.")
    formats = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    hf = formats.add_parser(
        "hf", help="a Hugging Face Llama folder",
        description="The folder's config.json decides the architecture; --config (the "
                    "training YAML the run will use) and --set decide the rest, e.g. "
                    "--set model.attention=kv_shift to add KV shifting to a stock Llama.")
    hf.add_argument("hf_dir", metavar="HF_DIR", help="a Llama folder (config.json, safetensors)")
    hf.add_argument("out", metavar="OUT_CHECKPOINT", help="the checkpoint folder to write (new)")
    hf.add_argument("--config", default=None, metavar="RUN.yaml",
                    help="the training config the run from this checkpoint will use")
    hf.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set model.kv_shift.window=2")
    hf.set_defaults(func=run)


def run(args) -> int:
    from kvtrain.hf import require_hf

    require_hf("kvtrain import")
    from kvtrain.commands.train import quiet_imports

    quiet_imports()
    from kvtrain.hf.importer import import_hf

    out = import_hf(args.hf_dir, args.out, config=args.config, overrides=args.overrides)
    held = " with the folder's tokenizer.model" if (out / "tokenizer.model").is_file() else ""
    print(f"kvtrain: imported {args.hf_dir} as {out}{held} (start a run from it with "
          f"checkpoint.resume: {out} and checkpoint.load_optimizer: false)")
    return 0
