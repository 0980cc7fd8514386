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
import time
from typing import Optional

from kvtrain.train.processes import record_launcher

# First thing, before the subcommands import torch and megatron (seconds): a
# launcher killed meanwhile must not be mistaken for the rank's new parent.
record_launcher()

from data_tools.fileio import PIPE_CLOSED, stdout_reader_gone  # noqa: E402
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


class Parser(argparse.ArgumentParser):
    """Refuses the arguments it does not know itself, with its own usage:
    argparse leaves a subcommand's to the top parser, whose error names
    ``kvtrain [-h] COMMAND ...`` and none of the subcommand's options. The
    subcommands' parsers are of this class too (add_subparsers' default)."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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


QUIET_WAIT_S = 20.0  # how long a node's other ranks leave the line to its first


def report(e: ConfigError, others_wait: Optional[float] = QUIET_WAIT_S) -> None:
    """Prints ``e``'s line to stderr. One that every rank raises alike
    (``same_on_every_rank``) is a node's first rank's to say: the others wait
    ``others_wait`` seconds, and torchrun, once that rank has exited, ends them
    unheard; so a refusal under torchrun is one line a node, not one a rank. A
    rank still there after the wait (no torchrun, or its first rank went on)
    says it too; ``others_wait`` None: the others say nothing (a caller whose
    ranks all run to their end, such as the tests' driver)."""
    if e.same_on_every_rank and os.environ.get("LOCAL_RANK", "0") != "0":
        if others_wait is None:
            return
        time.sleep(others_wait)  # exiting first, it would make torchrun end the one to say it
    print(error_line(e), file=sys.stderr, flush=True)


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
    except BrokenPipeError:
        if stdout_reader_gone():  # `kvtrain plan CONFIG | head`: the pipeline's end
            return PIPE_CLOSED
        raise


if __name__ == "__main__":
    sys.exit(main())
