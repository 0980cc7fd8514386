#!/usr/bin/env bash
# The check launch/torchrun.sh and launch/slurm.sbatch make before anything
# starts, so that a bad argument or config is one line here and not an error
# from every rank followed by torchrun's traceback:
# * the arguments are parsed by `kvtrain train`'s own parser (a stray argument,
#   a typo such as train.max_steps:50, is refused; the accepted set is the CLI's);
# * the config is loaded with the overrides (and the world size when known:
#   divisibility of heads, layers, batch);
# * the run's folders and the status file are checked as the trainer checks
#   them (a file where a folder goes), before any mkdir.
#
#   launch/precheck.sh PYTHON WORLD_SIZE RUN_DIR RUN_DIR_KEY CONFIG [kvtrain train args]
#
# The trainer arguments are in `kvtrain train`'s form (overrides as --set
# KEY=VALUE). WORLD_SIZE or RUN_DIR may be empty (not known, not given);
# RUN_DIR_KEY names where RUN_DIR came from (--run-dir, RUN_DIR) in a refusal.
# Prints the run folder and its checkpoint folder, one a line; after --help
# (kvtrain train's, on stderr) nothing. A refusal: one line on stderr, exit 2.
set -euo pipefail

usage="PYTHON WORLD_SIZE RUN_DIR RUN_DIR_KEY CONFIG [ARGS]"
[[ $# -ge 5 ]] || { echo "precheck.sh: usage: launch/precheck.sh $usage" >&2; exit 2; }
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=$1
shift

"$PYTHON" - "$@" <<'PY' || exit 2
import os
import sys
from argparse import ArgumentParser

from kvtrain.commands.train import check_output_folders, check_status_file, register
from kvtrain.config import ConfigError, checkpoint_folder, load_config, run_folder


class Parser(ArgumentParser):
    """argparse refuses with its usage and a line, once a rank: one line here.
    --help goes to stderr: stdout carries the folders."""

    def error(self, message):
        raise ConfigError(message)

    def print_help(self, file=None):
        super().print_help(sys.stderr)


def train_args(argv):
    """`kvtrain train ARGV` as the trainer parses it (its own register); None: --help."""
    parser = Parser(prog="kvtrain")
    register(parser.add_subparsers(dest="command"))
    try:
        args, stray = parser.parse_known_args(["train", *argv])
    except SystemExit:  # after --help
        return None
    if len(stray) == 1:
        raise ConfigError(f"unrecognized argument '{stray[0]}': neither a KEY=VALUE override "
                          "nor an option of kvtrain train")
    if stray:
        raise ConfigError(f"unrecognized arguments {', '.join(repr(a) for a in stray)}: "
                          "neither KEY=VALUE overrides nor options of kvtrain train")
    return args


def check(world, given, key, argv):
    # in the launchers' order: the trainer's last --run-dir (e.g. an abbreviation) wins
    args = train_args([argv[0], *(["--run-dir", given] if given else []), *argv[1:]])
    if args is None:
        return
    cfg = load_config(args.config, args.overrides, world_size=int(world) if world else None)
    run = run_folder(cfg, args.run_dir)
    named = "run_dir" if not args.run_dir else key if args.run_dir == given else "--run-dir"
    check_output_folders(cfg, run, named)
    check_status_file(args.status_file)
    ours = checkpoint_folder(cfg.checkpoint.dir, run)
    taken = os.environ.get("KVTRAIN_CHECKPOINT_DIR")
    if taken and os.path.abspath(taken) != os.path.abspath(ours):
        raise ConfigError(f"checkpoint.dir: the run's checkpoint folder is {ours}, but "
                          f"slurm.sbatch took CHECKPOINT_DIR={taken} (for the resume and the "
                          f"container's mounts): set CHECKPOINT_DIR={ours} (kvtrain submit does)")
    print(run)
    print(ours)


try:
    check(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
except ConfigError as e:
    sys.exit(f"kvtrain: {getattr(e, 'kind', 'config error')}: {e}")
PY
