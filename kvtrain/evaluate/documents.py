"""The documents of a task over the user's own files, checked before any model
loads, and a JSON-lines file's broken line named by its number.

lm-eval scores a multiple-choice document whose label is not one of its
choices as wrong (a warning that prints the document, or nothing for a label
like ``-1``), and ``datasets`` fills a field that a JSON line lacks with null,
which a template renders as the text ``None``: both gave a score, silently
wrong. A line that is not JSON was reported by pyarrow as a row counted from 0
inside its read block, or a byte position. Each is one line here naming the
file and the line (the document's number when its lines cannot be told).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from kvtrain.config import ConfigError, first_line

TEMPLATES = ("doc_to_text", "doc_to_target", "doc_to_choice")


def local_files(data_files: Any, split: Optional[str] = None) -> list[Path]:
    """The local paths of a YAML's ``dataset_kwargs.data_files`` (a path, a list, or
    ``{split: path or list}``; only ``split``'s when given) that exist as files."""
    if isinstance(data_files, dict):
        data_files = (data_files.get(split) if split is not None
                      else [p for v in data_files.values()
                            for p in (v if isinstance(v, list) else [v])])
    if isinstance(data_files, (str, Path)):
        data_files = [data_files]
    if not isinstance(data_files, list):
        return []
    paths = [Path(p).expanduser() for p in data_files if isinstance(p, (str, Path))]
    return [p for p in paths if p.is_file()]


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of the lines with something besides white space."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield number, raw


def _line_problem(raw: bytes) -> Optional[str]:
    raw = raw.rstrip(b"\r\n")  # a string cut short runs into it: columns of this line only
    try:  # -sig: a byte-order mark before the first line, which datasets reads
        value = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte {e.start + 1})"
    except json.JSONDecodeError as e:
        return f"invalid JSON at column {e.colno}: {e.msg}"
    if not isinstance(value, dict):
        text = raw.decode("utf-8-sig").strip()
        return f"not a JSON object: {text if len(text) <= 40 else text[:37] + '...'}"
    return None


def bad_line(paths: list[Path]) -> Optional[str]:
    """``FILE:LINE: WHAT`` for the first line of ``paths`` (JSON lines) that is not a
    JSON object; None when every line is one, or a file is one JSON document
    (``datasets`` reads an array of objects too)."""
    for path in paths:
        try:
            for index, (number, raw) in enumerate(_lines(path)):
                problem = _line_problem(raw)
                if problem is None:
                    continue
                if index == 0 and _one_document(path):
                    break
                return f"{path}:{number}: {problem}"
        except OSError:
            continue
    return None


def _one_document(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
        return True
    except (ValueError, OSError):
        return False


def _eval_split(task) -> Optional[str]:
    if task.has_test_docs():
        return task.config.test_split
    return task.config.validation_split if task.has_validation_docs() else None


def _locator(task) -> Callable[[int], str]:
    """Document index -> ``FILE:LINE`` when the evaluated split is one JSON-lines
    file read as it is (no process_docs: document i is its i-th line that is not
    blank), else ``document I of its SPLIT split``."""
    split = _eval_split(task)
    files = local_files((task.config.dataset_kwargs or {}).get("data_files"), split)
    numbers: list[int] = []
    if (task.config.dataset_path == "json" and task.config.process_docs is None
            and len(files) == 1 and bad_line(files) is None):
        numbers = [number for number, _ in _lines(files[0])]
        if len(numbers) != len(task.eval_docs):
            numbers = []
    return lambda i: (f"{files[0]}:{numbers[i]}" if numbers
                      else f"document {i} of its {split} split")


@contextlib.contextmanager
def _templates_compiled_once() -> Iterator[None]:
    """lm-eval compiles a template at every document (``apply_template``): most of
    the check's time. Here each is compiled once, rendered by the same environment."""
    from lm_eval import utils

    real, compiled = utils.apply_template, functools.lru_cache(maxsize=64)(utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compiled(template).render(**doc)

    utils.apply_template = apply_template
    try:
        yield
    finally:
        utils.apply_template = real


@functools.lru_cache(maxsize=64)
def _fields(template: str) -> tuple[str, ...]:
    """The names a jinja2 template reads from its document."""
    from jinja2 import meta

    from lm_eval.utils import env

    return tuple(sorted(meta.find_undeclared_variables(env.parse(template))))


def _rendered(task, attr: str, doc: dict) -> tuple[Any, Optional[str]]:
    """(what lm-eval makes of ``doc`` with the task's ``attr`` template, the problem)."""
    template = getattr(task.config, attr)
    quoted = json.dumps(template) if isinstance(template, str) else attr
    try:
        value = getattr(task, attr)(doc)
    except Exception as e:  # jinja2, a literal_eval of the choices, a field's type
        return None, f"its {attr} {quoted} cannot be applied: {first_line(e)}"
    if not isinstance(template, str):
        return value, None
    fields = (template,) if template in task.features else _fields(template)
    for name in fields:  # a null that went into the text ("None"), or the field itself
        if name in doc and doc[name] is None and (value is None or "None" in str(value)):
            return value, f"field '{name}' of {attr} {quoted} is missing (null)"
    return value, None


def _label_problem(task, values: dict) -> Optional[str]:
    """Why lm-eval's multiple-choice scoring cannot find the document's answer (its
    ``values``: what each template gave), or None."""
    choices = values.get("doc_to_choice")
    if not isinstance(choices, list) or not choices:
        return f"its doc_to_choice {json.dumps(task.config.doc_to_choice)} gives no choices"
    gold = values.get("doc_to_text" if task.multiple_input else "doc_to_target")
    for label in gold if isinstance(gold, list) else [gold]:
        index = isinstance(label, int) and not isinstance(label, bool)
        if not ((index and 0 <= label < len(choices)) or (isinstance(label, str)
                                                           and label in choices)):
            why = (" (datasets reads a column with one number like 1.0 as decimals)"
                   if isinstance(label, str) and label.endswith(".0") else "")
            return (f"its target {label!r} is not one of its {len(choices)} choices (an "
                    f"index 0-{len(choices) - 1} or a choice's text){why}; lm-eval scores it 0")
    return None


def _document_problem(task, doc: dict, choosing: bool) -> Optional[str]:
    values = {}
    for attr in TEMPLATES:
        if getattr(task.config, attr) is None:
            continue
        values[attr], problem = _rendered(task, attr, doc)
        if problem:
            return problem
    return _label_problem(task, values) if choosing else None


def _checked(task) -> bool:
    """A task of lm-eval's own kind over local files (``data_files``): its templates
    and default multiple-choice scoring are what this module knows."""
    from lm_eval.api.task import ConfigurableTask

    return (isinstance(task, ConfigurableTask) and task.config.dataset_kwargs is not None
            and bool(task.config.dataset_kwargs.get("data_files")))


def _opened(loaded: list) -> Iterator:
    """The tasks of ``loaded``, its groups opened."""
    from lm_eval.api.group import Group

    for item in loaded:
        yield from item.get_all_tasks() if isinstance(item, Group) else [item]


def document_at(loaded: list, task_name: Optional[str], index: Optional[int]) -> str:
    """``FILE:LINE`` of a task's evaluated document ``index``, else its number."""
    for task in _opened(loaded):
        try:
            if task.config.task == task_name:
                return _locator(task)(index)
        except AttributeError:  # not lm-eval 0.4.13's kind of task
            break
    return f"document {index}"


def check_requests(lm, requests: list, loaded: Optional[list] = None) -> None:
    """ConfigError naming the first loglikelihood request (its task, ``FILE:LINE``)
    whose continuation lm-eval cannot score: no tokens, or more than the model's
    window (lm-eval asserts both, a traceback after the model loaded). The
    continuation's tokens are lm-eval's own (``TemplateLM.loglikelihood``' split)."""
    window = lm.max_length
    for request in requests:
        context, continuation = request.args
        tokens = (lm.tok_encode(continuation, add_special_tokens=False) if context == ""
                  else lm._encode_pair(context, continuation)[1])
        if tokens and len(tokens) <= window:
            continue
        what = ("has no tokens" if not tokens else
                f"is {len(tokens)} tokens, more than the model's window of {window} (lm-eval "
                "keeps a continuation whole)")
        shown = continuation if len(continuation) <= 40 else continuation[:37] + "..."
        raise ConfigError(f"task '{request.task_name}': "
                          f"{document_at(loaded or [], request.task_name, request.doc_id)}: "
                          f"its continuation {shown!r} {what}; lm-eval cannot score it")


def check_documents(loaded: list, limit: Optional[float] = None) -> None:
    """ConfigError naming the first document (``FILE:LINE``) of a task over local
    files that lm-eval would score silently wrong: a template field it lacks (null),
    a template that fails on it, no choices, or a label outside its choices. Only
    the documents ``limit`` evaluates (lm-eval's rule: below 1, a fraction)."""
    from lm_eval.api.task import ConfigurableTask

    for task in _opened(loaded):
        try:  # lm-eval 0.4.13's task internals: another version's are left to it
            if not _checked(task):
                continue
            docs = task.eval_docs
            count = len(docs) if limit is None else (
                math.ceil(len(docs) * limit) if limit < 1 else int(limit))
            choosing = (task.OUTPUT_TYPE == "multiple_choice"
                        and task.config.process_results is None
                        and type(task).process_results is ConfigurableTask.process_results)
            with _templates_compiled_once():
                found = next(((i, problem) for i, doc in enumerate(itertools.islice(docs, count))
                              if (problem := _document_problem(task, doc, choosing))), None)
            if found:
                raise ConfigError(f"task '{task.config.task}': {_locator(task)(found[0])}: "
                                  f"{found[1]}")
        except AttributeError:
            continue


__all__ = ["bad_line", "check_documents", "check_requests", "document_at", "local_files"]
