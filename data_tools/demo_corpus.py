"""``kvtrain data demo-corpus``: a small real English corpus, built offline.

The text is the Python standard library's own documentation: the docstrings of
its modules, classes, methods and functions, and the language reference topics
that ``help()`` shows (about 2 MB of edited English with some code). It needs
no download, so ``make demo`` can run corpus -> tokenizer -> shards ->
training anywhere.

One JSON line per document: the module docstring, each public class with its
methods, each public function. Output is deterministic for a given Python
build: modules and members are visited in sorted order, only objects defined
in the module itself are taken (no re-exports, no duplicates), and signature
defaults whose repr could vary between runs or machines (memory addresses, set
order, environment-dependent objects, paths of this Python or checkout) are
written as ``...``.

Modules are imported in this process. Those with side effects on import
(opening a browser, printing, starting GUIs, terminal escape codes) or that
only exist on other platforms are never imported; warnings and anything
printed during imports are swallowed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import sys
import warnings

from data_tools.fileio import atomic_open, check_not_there

# Never imported: side effects on import, GUI/test suites, other platforms.
SKIP = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test",
    "lib2to3", "ensurepip", "pydoc_data", "readline", "msilib", "msvcrt", "nt",
    "winreg", "winsound", "_winapi", "xxsubtype", "__phello__", "__hello__",
}
# Submodule names that must not be imported (running them does something).
_SKIP_SUBMODULE_PARTS = {"__main__", "tests", "test", "idle_test"}
# Packages whose submodules are boilerplate (one per codec).
_NO_SUBMODULES = {"encodings"}

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class _Elided:
    def __repr__(self) -> str:
        return "..."


_ELIDED = _Elided()


def module_names() -> list[str]:
    """Public stdlib top-level modules and their public submodules, sorted."""
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP:
            continue
        names.append(name)
        if name in _NO_SUBMODULES:
            continue
        spec = importlib.util.find_spec(name) if _importable_spec(name) else None
        if spec is None or not spec.submodule_search_locations:
            continue
        for info in pkgutil.walk_packages(spec.submodule_search_locations, name + ".",
                                          onerror=lambda _: None):
            parts = info.name.split(".")
            if any(p.startswith("_") or p in _SKIP_SUBMODULE_PARTS for p in parts[1:]):
                continue
            names.append(info.name)
    return sorted(set(names))


def _importable_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _quiet_import(name: str):
    """Import with warnings and output swallowed; None if it fails."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit):
            return None


def _doc(obj) -> str:
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    return inspect.cleandoc(doc) if doc else ""


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = []
    for p in sig.parameters.values():
        if p.default is not inspect.Parameter.empty and not _stable_repr(p.default):
            p = p.replace(default=_ELIDED)
        params.append(p.replace(annotation=inspect.Parameter.empty))
    text = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    return _ADDRESS.sub("", text)


def _local_strings() -> tuple[str, ...]:
    """Where this Python and this process live (``platform.architecture`` defaults to
    ``sys.executable``): a default holding one would make the corpus, and every demo
    number after it, depend on the folder the project was cloned into."""
    values = {sys.executable, sys.prefix, sys.exec_prefix, sys.base_prefix, os.getcwd(),
              os.path.expanduser("~")}
    return tuple(v for v in values if v and len(v) > 1)


def _stable_repr(value) -> bool:
    if isinstance(value, (set, frozenset)):
        return False  # element order follows string hashing, random per run
    if isinstance(value, (str, bytes)):
        text = value if isinstance(value, str) else value.decode("utf-8", "replace")
        return not any(local in text for local in _local_strings())
    if value is None or isinstance(value, (bool, int, float, complex)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_stable_repr(v) for v in value)
    if isinstance(value, dict):
        return all(_stable_repr(k) and _stable_repr(v) for k, v in value.items())
    return False


def _is_routine(obj) -> bool:
    return inspect.isroutine(obj) or isinstance(obj, (classmethod, staticmethod))


def _class_text(module: str, name: str, cls) -> str:
    parts = []
    head = f"class {module}.{name}"
    if _doc(cls):
        parts.append(f"{head}\n\n{_doc(cls)}")
    for attr in sorted(vars(cls)):
        if attr.startswith("_") and attr not in ("__init__", "__call__"):
            continue
        member = vars(cls)[attr]
        if isinstance(member, (classmethod, staticmethod)):
            member = member.__func__
        if isinstance(member, property):
            doc = _doc(member)
            sig = ""
        elif _is_routine(member):
            doc = _doc(member)
            if attr == "__init__" and doc == _doc(object.__init__):
                continue
            sig = _signature(member)
        else:
            continue
        if doc:
            parts.append(f"{name}.{attr}{sig}\n\n{doc}")
    if parts and not _doc(cls):
        parts.insert(0, head)
    return "\n\n".join(parts)


def module_documents(name: str) -> list[tuple[str, str]]:
    """(id, text) documents of one module, in a deterministic order."""
    module = _quiet_import(name)
    if module is None:
        return []
    docs = []
    if _doc(module):
        docs.append((name, f"Module {name}\n\n{_doc(module)}"))
    seen = set()
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        obj = vars(module)[attr]
        if id(obj) in seen or getattr(obj, "__module__", None) != name:
            continue
        seen.add(id(obj))
        if inspect.isclass(obj):
            text = _class_text(name, attr, obj)
        elif _is_routine(obj) and _doc(obj):
            text = f"{name}.{attr}{_signature(obj)}\n\n{_doc(obj)}"
        else:
            continue
        if text:
            docs.append((f"{name}.{attr}", _ADDRESS.sub("", text)))
    return docs


def topic_documents() -> list[tuple[str, str]]:
    """The language reference topics behind ``help('assert')`` etc.: long-form
    English prose shipped with the interpreter (pydoc_data.topics)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [(f"topic.{key}", topics[key].strip()) for key in sorted(topics)
            if topics[key].strip()]


def iter_documents():
    """(id, text) of every document: module docstrings, then the help topics."""
    for name in module_names():
        yield from module_documents(name)
    yield from topic_documents()


def write(output: str, max_bytes: int | None = None) -> dict:
    """Write the corpus as JSON lines ({"id": ..., "text": ...}); atomic."""
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    docs = size = 0
    with atomic_open(output, "w", encoding="utf-8", newline="\n") as f:
        for doc_id, text in iter_documents():
            line = json.dumps({"id": f"stdlib:{doc_id}", "text": text}, ensure_ascii=False)
            f.write(line + "\n")
            docs += 1
            size += len(line.encode()) + 1
            if max_bytes and size >= max_bytes:
                break
    return {"documents": docs, "bytes": size, "python": sys.version.split()[0]}


def run(args) -> int:
    """CLI entry (see data_tools.cli)."""
    if args.max_mb is not None and not args.max_mb > 0:  # 0 silently meant no limit
        print(f"kvtrain data demo-corpus: error: --max-mb must be positive, got {args.max_mb}",
              file=sys.stderr)
        return 1
    if args.max_mb == float("inf"):  # was an OverflowError traceback
        print("kvtrain data demo-corpus: error: --max-mb must be finite (leave it out for the "
              "whole corpus), got inf", file=sys.stderr)
        return 1
    if not args.force:
        try:
            check_not_there([os.path.abspath(args.output)], "--output")
        except ValueError as e:
            print(f"kvtrain data demo-corpus: error: {e}", file=sys.stderr)
            return 1
    stats = write(args.output, int(args.max_mb * 1e6) if args.max_mb else None)
    print(f"demo-corpus: wrote {args.output}: {stats['documents']} documents, "
          f"{stats['bytes'] / 1e6:.1f} MB (Python {stats['python']} standard library docstrings)",
          file=sys.stderr)
    return 0
