"""``kvtrain demo``: the main job on the embedded default config, on CPU."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the end-to-end CPU demo")
    p.set_defaults(func=run)


def run(args) -> int:
    print("kvtrain demo: not yet (the trainer lands with the trainer issue)")
    return 0
