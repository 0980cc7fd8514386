"""``kvtrain sweep``: one config trained over a grid of settings, each cell a run.

The paper's Appendix H (Tables 6-13) is such a grid: the validation loss of each
attention at every learning rate and context length, one run a cell. A grid is
``--grid KEY=V1,V2,...`` (``kvtrain train``'s keys and value grammar, repeatable;
the cells are every combination, the first key slowest); ``--set`` applies to every
cell. Each cell is an ordinary ``kvtrain train`` run in ``DIR/arms/<cell>/run``,
trained by the experiment runner (``runner.run_arms``: a process per cell, N side
by side, a rerun continues unfinished cells and keeps finished ones), and the
results are the cells' final validation losses: ``sweep.md`` (a table over the last
two keys for each setting of the others, as the paper's tables), ``sweep.json``.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from kvtrain.config import ConfigError, RunConfig, load_config, to_dict

from .presets import Arm, owned_key

# kvtrain.train.loop.EXIT_NONFINITE (not imported: it imports torch): a cell stopped by
# train.max_consecutive_nonfinite steps in a row, a diverged run (Figure 4c's vanilla)
NONFINITE_EXIT = 3


@dataclass(frozen=True)
class Axis:
    """One grid key and its values (as given, and as YAML reads them)."""

    key: str
    texts: tuple[str, ...]

    @property
    def short(self) -> str:
        return self.key.rsplit(".", 1)[-1]


def _split_values(text: str) -> list[str]:
    """``1e-4,2e-4`` -> two values; commas inside brackets stay (``[a,b],[c]``)."""
    out, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    out.append(current.strip())
    return out


CELL_KEYS = ("name", "run_dir")  # what each cell's `kvtrain train` sets (commands/sweep.py)


def parse_grid(grids: list[str], sets: list[str]) -> list[Axis]:
    """The axes of ``--grid KEY=V1,V2`` flags; one line for a malformed one, a key
    given twice, or a key also in ``--set`` (the grid would not vary it)."""
    axes: list[Axis] = []
    set_keys = {s.partition("=")[0].strip() for s in sets}
    for flag, assignments in (("--set", sets), ("--grid", grids)):
        for assignment in assignments:  # the cell's command sets them after the user's
            if owned_key(assignment, CELL_KEYS) is not None:
                key = assignment.partition("=")[0].strip()
                raise ConfigError(f"{flag} {key}: the sweep sets it for each cell (its folder: "
                                  "--run-dir DIR/arms/CELL/run; its name: the config's and "
                                  "the cell's)")
    for grid in grids:
        key, eq, values = grid.partition("=")
        key = key.strip()
        texts = _split_values(values) if eq else []
        if not key or not texts or any(not t for t in texts):
            raise ConfigError(f"--grid {grid!r}: expected KEY=V1,V2,... (e.g. "
                              "optimizer.lr=1e-4,2e-4)")
        if key in {a.key for a in axes}:
            raise ConfigError(f"--grid {key}: given twice; list all its values in one --grid")
        if key in set_keys:
            raise ConfigError(f"--grid {key}: also in --set, which would fix it in every cell")
        if len(set(texts)) < len(texts):
            raise ConfigError(f"--grid {key}: a value is listed twice ({', '.join(texts)})")
        axes.append(Axis(key, tuple(texts)))
    if not axes:
        raise ConfigError("kvtrain sweep needs at least one --grid KEY=V1,V2,...")
    return axes


def _value_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "_"


def cell_name(axes: list[Axis], texts: tuple[str, ...]) -> str:
    """``lr=1e-4,seq_length=256``: each axis by its last key part (its whole key where
    two axes share one)."""
    shorts = [a.short for a in axes]
    names = [a.short if shorts.count(a.short) == 1 else a.key for a in axes]
    return ",".join(f"{n}={_value_name(t)}" for n, t in zip(names, texts))


@dataclass
class Cell:
    name: str
    texts: tuple[str, ...]  # the grid's values, as given, in the axes' order
    settings: dict[str, object]  # grid key -> the value the cell's run reads
    overrides: list[str]  # the --set assignments of the cell (the grid's last)
    cfg: RunConfig


def sweep_cells(config: Optional[str], sets: list[str], axes: list[Axis],
                world_size: int = 1) -> list[Cell]:
    """Every cell's validated config (the grid's first key slowest); one line naming
    the cell for a setting that does not hold."""
    load_config(config, sets, world_size=world_size)  # the config and --set: their own lines
    cells = []
    for texts in itertools.product(*(a.texts for a in axes)):
        name = cell_name(axes, texts)
        assignments = [f"{a.key}={t}" for a, t in zip(axes, texts)]
        try:
            cfg = load_config(config, [*sets, *assignments], world_size=world_size)
        except ConfigError as e:  # the grid's values (given as --set to the loader)
            raise ConfigError(f"cell {name}: {str(e).replace('--set', '--grid', 1)}") from None
        cfg.name = f"{cfg.name}-{name}"
        cells.append(Cell(name, texts, {a.key: _value_at(cfg, a.key) for a in axes},
                          [*sets, *assignments], cfg))
    _check_shareable(cells)
    return cells


def check_shards(cells: list[Cell]) -> None:
    """A shard a cell reads that is missing or damaged (the header and sizes:
    ``check_shard``'s O(1) reads): one line before any cell trains. Each cell
    found it only once started, seconds each, the same line each. Not for
    ``--dry-run``, whose commands may run where other files are mounted."""
    from data_tools.indexed import check_shard

    seen = set()
    for cell in cells:
        d = cell.cfg.data
        if d.type != "gpt":
            continue
        named = [("data.paths", d.paths), ("data.valid_paths", d.valid_paths),
                 *((f"data.valid_sets.{n}", p) for n, p in d.valid_sets.items())]
        for key, paths in named:
            for prefix in (p for p in paths if isinstance(p, str)):  # a blend's weights: numbers
                if prefix not in seen and (problem := check_shard(prefix)) is not None:
                    raise ConfigError(f"cell {cell.name}: {key}: shard {problem}")
                seen.add(prefix)


def _value_at(cfg: RunConfig, key: str):
    """The config's value of a dotted key, as the run reads it (``1e-3``: 0.001)."""
    node = to_dict(cfg)
    for part in key.split("."):
        node = node[part]
    return node


def _check_shareable(cells: list[Cell]) -> None:
    """What cells would share, and must not: an absolute checkpoint.dir that two
    cells name (one would resume the other's checkpoint, its learning rate only
    recorded as changed; a grid over absolute folders gives each its own), or no
    validation (the table reads each cell's validation loss)."""
    owners: dict[Path, str] = {}
    for cell in cells:
        folder = cell.cfg.checkpoint.dir
        if not folder or not Path(folder).expanduser().is_absolute():
            continue  # inside the cell's own run folder
        where = Path(os.path.normpath(Path(folder).expanduser()))
        if where in owners:
            what = ("every cell of the sweep" if len(owners) == 1 == len({c.cfg.checkpoint.dir
                                                                          for c in cells})
                    else f"cells {owners[where]} and {cell.name}")
            raise ConfigError(f"checkpoint.dir {folder} is one folder for {what}: leave it "
                              "out or relative (each cell's run folder holds its own)")
        owners[where] = cell.name
    for cell in cells:
        if cell.cfg.train.eval_interval is None:
            named = f"cell {cell.name}: " if len(cells) > 1 else ""
            raise ConfigError(f"{named}train.eval_interval null: the sweep's table is each "
                              "cell's validation loss; give it an interval")


def as_arms(cells: list[Cell]) -> list[tuple[Arm, RunConfig]]:
    """The cells as the experiment runner's arms (one ``kvtrain train`` run each)."""
    return [(Arm(c.name, c.cfg.model.attention, c.cfg.model.num_layers), c.cfg) for c in cells]


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def entries(cells: list[Cell], results: list) -> list[dict]:
    """What ``sweep.json`` holds of each cell: its settings and its run's last
    validation (``results``: the runner's ``ArmResult`` of each cell)."""
    from kvtrain.analysis.scaling import size_of
    from kvtrain.config.layout import total_steps

    out = []
    for cell, result in zip(cells, results):
        last = result.rows[-1] if result.rows else {}
        loss = last.get("loss")
        finished = result.exit_code == 0 and (last.get("step") or 0) >= total_steps(cell.cfg)[0]
        out.append({"cell": cell.name, "texts": list(cell.texts), "settings": cell.settings,
                    "params": size_of(cell.cfg.model)[0],  # as kvtrain scaling counts
                    "step": last.get("step"), "finished": finished,
                    "val_loss": loss if isinstance(loss, float) and math.isfinite(loss) else None,
                    "train_loss": last.get("train_loss"), "exit_code": result.exit_code,
                    "wall_s": round(result.wall_s, 1)})
    return out


def report(config: str, sets: list[str], axes: list[Axis], cells: list[dict],
           extra: Sequence[str] = ()) -> str:
    """``sweep.md``: the tables, then ``extra`` (the arms pair by pair, the scaling)."""
    fixed = f"; every cell with {', '.join(sets)}" if sets else ""
    return "\n".join(["# kvtrain sweep", "", f"`{config}`: the final validation loss of each "
                      f"cell (the lowest of each table in bold){fixed}.", ""]
                     + tables(axes, cells) + ([""] + list(extra) if extra else [])) + "\n"


def tables(axes: list[Axis], entries: list[dict]) -> list[str]:
    """Markdown: the final validation loss over the last two axes (rows: the one before
    last; one table per setting of the axes before; one column for a one-axis grid),
    the best cell of each table in bold."""
    rows_axis, cols_axis = (axes[-2], axes[-1]) if len(axes) > 1 else (axes[-1], None)
    groups = axes[:-2] if len(axes) > 1 else []
    by_texts = {tuple(e["texts"]): e for e in entries}
    lines = []
    for outer in itertools.product(*(a.texts for a in groups)):
        cells = [e for t, e in by_texts.items() if t[:len(outer)] == outer]
        finite = [e["val_loss"] for e in cells if e["val_loss"] is not None
                  and math.isfinite(e["val_loss"])]
        best = min(finite, default=None)
        if groups:
            lines += ["", "**" + ", ".join(f"{a.key} = {t}" for a, t in zip(groups, outer)) + "**",
                      ""]
        cols = cols_axis.texts if cols_axis else ("val loss",)
        lines += [f"| {rows_axis.key} \\ {cols_axis.key if cols_axis else ''} | "
                  + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        for r in rows_axis.texts:
            values = []
            for c in (cols_axis.texts if cols_axis else (None,)):
                entry = by_texts.get(outer + ((r, c) if cols_axis else (r,)))
                loss = entry["val_loss"] if entry else None
                text = _fmt(loss)
                if entry and entry.get("exit_code") == NONFINITE_EXIT:
                    text += f" (stopped at step {entry['step']}: non-finite losses)"
                elif entry and loss is not None and not entry.get("finished", True):
                    text += f" (step {entry['step']}, unfinished)"
                values.append(f"**{text}**" if loss is not None and loss == best else text)
            lines.append(f"| {r} | " + " | ".join(values) + " |")
    return lines


__all__ = ["Axis", "Cell", "as_arms", "cell_name", "entries", "parse_grid", "report",
           "sweep_cells", "tables"]
