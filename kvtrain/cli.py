"""The ``kvtrain`` command: one subcommand per module.

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` to a callable taking the parsed args and returning an exit
code. Subcommands are imported lazily by name so that ``kvtrain data ...``
never imports torch or megatron.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvtrain.train.processes import record_launcher

# First thing, before the subcommands import torch and megatron (seconds): a
# launcher killed meanwhile must not be mistaken for the rank's new parent.
record_launcher()

from data_tools.lifeline import Terminated  # noqa: E402
from kvtrain.config import ConfigError  # noqa: E402

# name -> module with register(subparsers)
SUBCOMMANDS = {
    "train": "kvtrain.commands.train",
    "data": "data_tools.cli",
    "plan": "kvtrain.commands.plan",
    "submit": "kvtrain.commands.submit",
    "experiment": "kvtrain.commands.experiment",
    "demo": "kvtrain.commands.demo",
    "export": "kvtrain.commands.export",
    "import": "kvtrain.commands.importer",
    "eval": "kvtrain.commands.eval",
    "generate": "kvtrain.commands.generate",
    "perplexity": "kvtrain.commands.perplexity",
    "compare": "kvtrain.commands.compare",
    "sweep": "kvtrain.commands.sweep",
    "scaling": "kvtrain.commands.scaling",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrain",
        description="Pretrain Llama-style LMs with KV shifting attention on Megatron-Core.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def error_line(e: ConfigError) -> str:
    """The one line a bad input or a fault is reported with (no traceback); a
    subclass names its kind in ``kind`` (e.g. "checkpoint error")."""
    return f"kvtrain: {getattr(e, 'kind', 'config error')}: {e}"


def report(e: ConfigError) -> None:
    """Prints ``e``'s line to stderr; one that every rank raises alike
    (``same_on_every_rank``) only from a node's first rank, so that a refusal
    under torchrun is one line a node, not one a rank."""
    if e.same_on_every_rank and os.environ.get("LOCAL_RANK", "0") != "0":
        return
    print(error_line(e), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        report(e)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:  # a runner's stop (kvtrain.experiments.children): its runs were stopped
        return 143


if __name__ == "__main__":
    sys.exit(main())
