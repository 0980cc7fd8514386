"""Strict loading of nested typed dataclasses from YAML.

Every config section is a plain ``@dataclass`` whose fields carry type hints
(int, float, str, bool, Optional[X], list[X], dict[str, X] (a mapping of names),
Literal[...], nested dataclasses).
``from_dict`` walks the hints and refuses anything it does not know:

* an unknown key is an error naming its full dotted path and the closest valid
  key ("unknown key 'model.hiden_size' (did you mean 'model.hidden_size'?)");
* a value of the wrong type names the key, the type expected and the value;
* errors in a YAML file also name the file and line.

``--set a.b=value`` overrides are parsed as YAML scalars and pass through the
same checks, so a typo on the command line fails the same way as in the file.
A mapping's entry is set as ``--set a.b.NAME=value`` (``null`` removes it).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A config problem, reported as one line without a traceback by the CLI.

    ``same_on_every_rank``: every rank of a launch raises it with this message
    (a collective decided it, or each read the same config): the CLI says it
    once per node, not once per rank (``kvtrain.cli.report``)."""

    same_on_every_rank = False


def on_every_rank(error: ConfigError) -> ConfigError:
    """``error``, marked as raised alike by every rank (``same_on_every_rank``)."""
    error.same_on_every_rank = True
    return error


class _Unusable(ConfigError):
    """A value of the right type that no setting takes (a float nan or inf, a string
    holding NUL): reported as such, also for an optional setting."""


def first_line(exc: BaseException) -> str:
    """``"<Type>: <first line of the message>"``: an exception inside a one-line report."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ----------------------------------------------------------------------------- YAML with lines
class _Loader(yaml.SafeLoader):
    """SafeLoader whose zero-padded integers are decimal (see ``_construct_int``)."""


_LEADING_ZERO = re.compile(r"[-+]?0[0-7]+")


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    """YAML 1.1 reads ``010`` as octal 8 but ``08`` (not octal) as a string that
    becomes 8: ``seed: 010`` ran seed 8. A config number is decimal: 010 is 10."""
    text = loader.construct_scalar(node).replace("_", "")
    if _LEADING_ZERO.fullmatch(text):
        return int(text, 10)
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def parse_value(text: str) -> Any:
    """A ``--set`` value: a YAML scalar or flow value, read as a file's values are."""
    return yaml.load(text, Loader=_Loader)


class _LineLoader(_Loader):
    """The config loader that records the line of every mapping key (1-based)."""


_MERGE = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    # YAML merge keys (`<<: *base`): the base's entries first, then this mapping's
    # own, which may replace them (a duplicate among its own is still refused)
    own = sum(key.tag != _MERGE for key, _ in node.value)
    if own < len(node.value):
        try:
            loader.flatten_mapping(node)
        except yaml.MarkedYAMLError as e:  # the mapping of the `<<`, not its base's
            mark = e.context_mark or e.problem_mark
            raise ConfigError(f"{loader.name}:{mark.line + 1}: invalid YAML: "
                              f"{e.problem}") from None
    merged = len(node.value) - own
    mapping = {}
    lines = {}
    for index, (key_node, value_node) in enumerate(node.value):
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, (list, dict)):  # YAML's `? [a, b]`: unhashable, and no key
            raise ConfigError(f"{loader.name}:{key_node.start_mark.line + 1}: a key must be "
                              f"a name, got a {'list' if isinstance(key, list) else 'mapping'}")
        if key in mapping and lines[key][1] >= merged:  # twice among its own
            raise ConfigError(
                f"{loader.name}:{key_node.start_mark.line + 1}: duplicate key {key!r}"
            )
        mapping[key] = loader.construct_object(value_node, deep=deep)
        lines[key] = (key_node.start_mark.line + 1, index)
    return _LinedDict(mapping, {key: line for key, (line, _) in lines.items()})


class _LinedDict(dict):
    """A dict that remembers the YAML line of each key."""

    def __init__(self, data: dict, lines: dict):
        super().__init__(data)
        self.lines = lines


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str | Path) -> dict:
    """Reads a YAML mapping, keeping key lines; errors name the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x})") \
            from None
    loader = _LineLoader(text)
    loader.name = str(path)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: invalid YAML: {e.problem}") from None
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise ConfigError(f"{path}: nested too deeply to read (no config is)") from None
    finally:
        loader.dispose()
    if data is None:
        return _LinedDict({}, {})
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------- typed conversion
def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        return f"list of {_type_name(inner)}"
    if origin is dict:
        return f"mapping of names to {_type_name(get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _where(key: str, source: str | None, line: int | None) -> str:
    if source and line:
        return f"{source}:{line}: {key}"
    if source:
        return f"{source}: {key}"
    return key


def _convert(tp: Any, value: Any, key: str, source: str | None, line: int | None) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{_where(key, source, line)}: expected a mapping (section {tp.__name__}), "
                f"got {value!r}"
            )
        return from_dict(tp, value, prefix=key, source=source)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key, source, line)
            except ConfigError as e:
                errors.append(e)
        # a number that is not finite says so, not "expected float | null"
        for e in errors:
            if isinstance(e, _Unusable):
                raise e
        raise ConfigError(
            f"{_where(key, source, line)}: expected {_type_name(tp)}, got {value!r}"
        )
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{_where(key, source, line)}: expected one of "
                f"{', '.join(repr(c) for c in choices)}, got {value!r}"
            )
        return value
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_where(key, source, line)}: expected {_type_name(tp)}, got {value!r}")
        return [_convert(inner, v, f"{key}[{i}]", source, line) for i, v in enumerate(value)]
    if origin is dict:
        return _convert_mapping(tp, value, key, source, line)
    if tp is Any:
        return value
    scalar = _SCALARS.get(tp)
    if scalar is not None:
        return scalar(value, _where(key, source, line))
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _convert_mapping(tp: Any, value: Any, key: str, source: str | None,
                     line: int | None) -> dict:
    """``dict[str, X]``: a mapping whose keys are names (``{code: [...], wiki: [...]}``);
    each value converted as ``key.NAME``, on its own line."""
    if not isinstance(value, dict):
        raise ConfigError(f"{_where(key, source, line)}: expected {_type_name(tp)}, got {value!r}")
    _, inner = get_args(tp)
    lines = getattr(value, "lines", {})
    out = {}
    for name, v in value.items():
        at = lines.get(name, line)
        if not isinstance(name, str) or not name:  # YAML reads `1:` or `true:` as others
            raise ConfigError(f"{_where(key, source, at)}: a name must be a non-empty "
                              f"string, got {name!r}")
        out[name] = _convert(inner, v, f"{key}.{name}", source, at)
    return out


def _to_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected bool, got {value!r}")
    return value


def _to_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # Allow whole numbers written 1e9 / 1.0e9 (token budgets); PyYAML
        # reads an exponent without a sign as a string.
        number = _as_float(value)
        if number is None or not number.is_integer():
            raise ConfigError(f"{where}: expected int, got {value!r}")
    # numpy, torch and megatron hold ints in 64 bits: a larger one hung the
    # trainer (max_steps) or forked without end (num_workers), never an error
    number = int(value if isinstance(value, int) else number)
    if not -2**63 <= number < 2**63:
        raise ConfigError(f"{where}: expected a 64-bit int, got {value!r}")
    return number


def _to_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        # PyYAML reads "1e-4" (no dot) as a string: accept numeric strings.
        number = _as_float(value)
        if number is None:
            raise ConfigError(f"{where}: expected float, got {value!r}")
    else:
        number = float(value)
    if not math.isfinite(number):
        # nan passes every `<= 0` check, and no float setting gives inf a meaning
        raise _Unusable(f"{where}: expected a finite number, got {value!r}")
    return number


def _to_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected str, got {value!r}")
    if "\0" in value:  # no path or name holds one (a ValueError deep in a later open)
        raise _Unusable(f"{where}: holds a NUL character (\\0)")
    return value


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _as_float(value: Any) -> float | None:
    if isinstance(value, float):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a config dataclass's fields."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def from_dict(cls: type, data: dict, prefix: str = "", source: str | None = None):
    """Builds ``cls`` from ``data``, refusing unknown keys and wrong types."""
    hints = field_hints(cls)
    lines = getattr(data, "lines", {})
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            candidates = [f"{prefix}.{k}" if prefix else k for k in hints]
            close = difflib.get_close_matches(path, candidates, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{_where(repr(path), source, lines.get(key))}: unknown key{hint}")
        kwargs[key] = _convert(hints[key], value, path, source, lines.get(key))
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """Plain-dict form of a config (for saving and printing)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- overrides
def apply_override(data: dict, assignment: str, cls: type) -> None:
    """Applies one ``a.b.c=value`` override to a raw config dict, in place.

    The path is checked against ``cls`` so a misspelt key fails here with the
    same message as in a file; the value is parsed as a YAML scalar/flow value.
    A mapping given for a section is merged into the file's section key by key.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE")
    path, raw = assignment.split("=", 1)
    try:
        value = parse_value(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        why = getattr(e, "problem", None) or first_line(e)  # str(e) spans lines
        raise ConfigError(f"--set {path}: cannot parse value {raw!r}: {why}") from None
    except RecursionError:
        raise ConfigError(f"--set {path}: the value is nested too deeply to read") from None
    _set_path(data, path.strip().split("."), value, cls)


def _set_path(data: dict, parts: list[str], value: Any, cls: type) -> None:
    """Sets ``parts`` (a dotted key) to ``value`` in ``data``, checking both."""
    node = data
    section = cls
    for i, part in enumerate(parts):
        hints = field_hints(section)
        dotted = ".".join(parts[: i + 1])
        if part not in hints:
            prefix = ".".join(parts[:i])
            candidates = [f"{prefix}.{k}" if prefix else k for k in hints]
            close = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"--set: unknown key '{dotted}'{hint}")
        tp = _unwrap_optional(hints[part])
        if get_origin(tp) is dict and i == len(parts) - 2:  # a.b.NAME: one entry
            _set_entry(node, part, parts[-1], value, tp, ".".join(parts))
            return
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp) and isinstance(value, dict):
                # A section given whole replaced the file's section, silently
                # dropping its other keys: merge it one key at a time instead
                # ({} merges nothing; it switches on an optional section left out).
                if not value and not isinstance(node.get(part), dict):
                    node[part] = {}
                for key, inner in value.items():
                    _set_path(data, [*parts, str(key)], inner, cls)
                return
            # Checked here, so that a bad value is blamed on the --set and not
            # on the line of the file it replaces.
            _convert(hints[part], value, dotted, "--set", None)
            node[part] = value
        else:
            if not dataclasses.is_dataclass(tp):
                what = "its entries are NAME=value" if get_origin(tp) is dict else "not a section"
                raise ConfigError(f"--set: '{dotted}' is a {_type_name(tp)}, {what}")
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node, section = child, tp


def _set_entry(node: dict, part: str, name: str, value: Any, tp: Any, dotted: str) -> None:
    """``--set a.b.NAME=value``: one entry of the mapping ``a.b`` set (kept with the
    file's others), or removed by ``null``."""
    current = node.get(part)
    mapping = _LinedDict(current if isinstance(current, dict) else {},
                         dict(getattr(current, "lines", {})))  # the file's entries keep their lines
    if value is None:
        mapping.pop(name, None)
    else:
        _convert(get_args(tp)[1], value, dotted, "--set", None)
        mapping[name] = value
    node[part] = mapping


def _unwrap_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=None)


__all__ = [
    "ConfigError",
    "read_yaml",
    "from_dict",
    "to_dict",
    "apply_override",
    "dump_yaml",
    "field_hints",
]
