"""lm-evaluation-harness as a library, fully offline, on a Hugging Face folder.

Everything runs from local files: the Hugging Face switches that forbid the hub
are set before lm-eval, ``datasets`` or ``transformers`` are imported (and in
their modules when something imported them earlier), tasks come from lm-eval's
own task folder or ``--include-path`` folders of task YAMLs (``dataset_path:
json`` with local ``data_files``, or a dataset already in the local datasets
cache). A task that cannot be loaded is reported in one line naming the task
and its dataset (``ConfigError``), before any model is built.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from kvtrain.config import ConfigError, first_line
from kvtrain.hf import HF_EXTRA, offline

from .documents import bad_line, check_documents, check_requests, local_files
from .source import window_of

# every switch the Hugging Face libraries read to stay off the network
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype -> transformers' name
DEFAULT_DTYPE = "fp32"  # results files name any other dtype


@dataclass
class EvalSpec:
    """What to evaluate and how (the command line of ``kvtrain eval``)."""

    tasks: list[str]
    num_fewshot: Optional[int] = None
    limit: Optional[float] = None  # examples per task; < 1: a fraction
    include_path: Optional[Path] = None
    batch_size: int = 8
    device: str = "cpu"
    dtype: str = DEFAULT_DTYPE
    bootstrap_iters: int = 1000  # stderr of non-mean metrics (perplexity); 0: none
    log_samples: bool = False
    seed: int = 1234
    trust_remote_code: bool = False  # run code of a folder kvtrain did not export
    # tokens of context + continuation scored at most (None: a kvtrain export's
    # train.seq_length, another folder's lm-eval default, max_position_embeddings)
    max_length: Optional[int] = None

    def as_record(self) -> dict[str, Any]:
        """The settings saved next to the results."""
        return {"tasks": list(self.tasks), "num_fewshot": self.num_fewshot, "limit": self.limit,
                "include_path": str(self.include_path) if self.include_path else None,
                "batch_size": self.batch_size, "device": self.device, "dtype": self.dtype,
                "bootstrap_iters": self.bootstrap_iters, "seed": self.seed,
                "trust_remote_code": self.trust_remote_code, "max_length": self.max_length}


@dataclass
class EvalOutput:
    """lm-eval's answer, reduced to what kvtrain keeps."""

    tasks: dict[str, dict[str, float]]  # task (or group) -> metric -> value
    n_samples: dict[str, int]  # task -> examples evaluated
    n_shot: dict[str, int]
    versions: dict[str, Any]
    samples: list[dict] = field(default_factory=list)  # per request, with log_samples
    lm_eval_version: str = ""
    max_length: Optional[int] = None  # the window lm-eval scored within


def import_harness():
    """lm_eval, offline; ConfigError naming the extra when it is not installed."""
    offline()
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401 (HFLM; imports transformers, accelerate)
    except ImportError as e:
        raise ConfigError(f"kvtrain eval needs lm-evaluation-harness and transformers "
                          f"({first_line(e)}): {HF_EXTRA}") from None
    # lm-eval logs every request batch at INFO; its warnings stay visible
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    return lm_eval


@functools.lru_cache(maxsize=4)
def task_manager(include_path: Optional[Path] = None, defaults: bool = True):
    """lm-eval's task index (its own tasks when ``defaults``, + ``include_path``):
    built once per process and folders, since indexing lm-eval's ~15k task YAMLs
    takes seconds (tens on a loaded machine)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path}: no such folder")
    return TaskManager(include_path=str(include_path) if include_path else None,
                       include_defaults=defaults)


class UnknownTask(ConfigError):
    """A task name no index knows."""


def _skipped_yaml(folder: Path) -> list[str]:
    """The YAMLs under ``folder`` that lm-eval's task index skips without a word
    (it logs them at DEBUG), each as ``PATH:LINE: invalid YAML: PROBLEM`` or
    ``PATH: WHY``; [] when lm-eval's loader is not where 0.4.13 keeps it."""
    import yaml

    try:
        from lm_eval.tasks._index import TaskIndex
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:
        return []
    files = getattr(TaskIndex, "_iter_yaml_files", None)  # the files, in its order
    if files is None:
        return []
    skipped = []
    for path in files(Path(folder)):
        try:
            load_yaml(path, resolve_func=False)
        except yaml.MarkedYAMLError as e:
            line = f":{e.problem_mark.line + 1}" if e.problem_mark else ""
            # an unclosed bracket or quote is found at the end: say where it opened
            opened = (f" ({e.context} from line {e.context_mark.line + 1})"
                      if e.context and e.context_mark else "")
            skipped.append(f"{path}{line}: invalid YAML: {e.problem or first_line(e)}{opened}")
        except Exception as e:  # not a mapping, a missing include: skipped alike
            skipped.append(f"{path}: {first_line(e)}")
    return skipped


def _unknown(manager, name: str) -> UnknownTask:
    """The one line for a task no index holds: a YAML the index skipped may be why."""
    folder = manager.include_path
    skipped = _skipped_yaml(folder) if folder else []
    if skipped:
        more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
        return UnknownTask(f"--include-path {folder}: {skipped[0]}{more} (lm-eval's task index "
                           f"skips it; task '{name}' is in no other YAML there nor one of "
                           "lm-eval's tasks)")
    where = (f"nor in --include-path {folder}" if folder
             else "(a local task needs --include-path DIR)")
    return UnknownTask(f"unknown task '{name}': not one of lm-eval's tasks {where}")


def _config_of(manager, name: str) -> dict:
    """The task's YAML as the index read it ({} when it has none)."""
    entry = manager.task_index.get(name)
    return (getattr(entry, "cfg", None) or {}) if entry is not None else {}


def _dataset_of(manager, name: str) -> str:
    """The dataset a task names in its YAML (path, name, data files), for messages."""
    cfg = _config_of(manager, name)
    if not cfg.get("dataset_path"):
        return ""
    parts = [str(cfg["dataset_path"])]
    if cfg.get("dataset_name"):
        parts.append(f"name {cfg['dataset_name']}")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if files:
        parts.append(f"data_files {json.dumps(files)}")
    return " ".join(parts)


def _unavailable(manager, name: str, error: Exception) -> ConfigError:
    """The one line for a task whose dataset could not be read offline."""
    dataset = _dataset_of(manager, name)
    what = f"dataset {dataset}" if dataset else "its dataset"
    if isinstance(error, ConnectionError) or "offline" in str(error).lower():
        why = "not in the local datasets cache (kvtrain eval never downloads)"
        return ConfigError(f"task '{name}': {what} is not available offline: {why}")
    while error.__cause__ is not None:  # datasets wraps the reader's error ("raise ... from")
        error = error.__cause__
    template = _template_of(error)
    if template is not None:  # the documents were read: a template asks what they lack
        which = f"its template {template}" if template else "a template of its YAML"
        return ConfigError(f"task '{name}': {which} cannot be applied to its documents: "
                           f"{first_line(error)}")
    cfg = _config_of(manager, name)  # pyarrow counts rows from 0 in its block: the line
    line = (bad_line(local_files((cfg.get("dataset_kwargs") or {}).get("data_files")))
            if cfg.get("dataset_path") == "json" else None)
    return ConfigError(f"task '{name}': {what} cannot be read: {line or first_line(error)}")


def _template_of(error: Exception) -> Optional[str]:
    """``KEY "TEMPLATE"`` of the jinja2 template that raised ``error`` (from lm-eval's
    ``apply_template`` frame and its caller, a Task's ``doc_to_*``; "" when no such
    frame), or None for an error that is no template's."""
    from jinja2 import TemplateError

    if not isinstance(error, TemplateError):
        return None
    tb, caller, found = error.__traceback__, "", None
    while tb is not None:  # outermost first: the frame before apply_template called it
        frame = tb.tb_frame
        if frame.f_code.co_name == "apply_template" and isinstance(
                frame.f_locals.get("template"), str):
            text = frame.f_locals["template"]
            text = json.dumps(text if len(text) <= 80 else text[:77] + "...")
            found = f"{caller} {text}" if caller.startswith("doc_to_") else text
        caller = frame.f_code.co_name
        tb = tb.tb_next
    return found or ""


@contextlib.contextmanager
def _errors_only(logger: str = "lm_eval", level: int = logging.ERROR) -> Iterator[None]:
    """lm-eval logs at WARNING every default it fills into a task's metrics while
    building tasks; a refused task must be one line, so only errors show here."""
    log = logging.getLogger(logger)
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """datasets draws a progress bar on stderr while it prepares a split it has not
    cached: a task refused after another was prepared would not be one line."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars
    from datasets.utils import enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def _build(manager, names: list[str]) -> list:
    """lm-eval Task / Group objects of ``names`` from ``manager`` (datasets read now)."""
    loaded = []
    for name in names:
        try:
            # datasets logs a reader's error before raising it: the one line names it
            with _errors_only(), _errors_only("datasets", logging.CRITICAL), \
                    _no_progress_bars():
                built = manager.load([name])
        except KeyError:
            raise _unknown(manager, name) from None
        except Exception as e:  # datasets' errors have no common base: name the task
            raise _unavailable(manager, name, e) from None
        if name in built["groups"]:
            loaded.append(built["groups"][name])
        else:  # a task, or a tag naming several tasks
            loaded.extend(built["tasks"].values())
    return loaded


def load_tasks(names: list[str], include_path: Optional[Path] = None) -> tuple[Any, list]:
    """(the task index used, the Task / Group objects of ``names``), or
    ConfigError naming the first task that is unknown or has no local data.

    Tasks all found in ``include_path`` are loaded from an index of that folder
    alone (lm-eval's own ~15k YAMLs are not indexed); otherwise, or when a local
    group names lm-eval's tasks, from lm-eval's index + the folder."""
    if include_path is not None:
        local = task_manager(include_path, defaults=False)
        if all(name in local.all_tasks for name in names):
            try:
                return local, _build(local, names)
            except UnknownTask:
                pass
    full = task_manager(include_path, defaults=True)
    return full, _build(full, names)


def _shots(task, asked: Optional[int]) -> tuple[int, str]:
    """(the shots lm-eval will give ``task``, how they were asked for): ``--num-fewshot``
    overrides the task's own num_fewshot unless that is 0 (``simple_evaluate``'s rule)."""
    own = task.get_config("num_fewshot")
    if asked is not None and own != 0:
        return asked, f"--num-fewshot {asked}"
    return own or 0, f"num_fewshot {own} (its YAML)"


def _fewshot_source(task) -> str:
    """The split (or samples) lm-eval draws ``task``'s few-shot examples from, in words
    (``ConfigurableTask.fewshot_docs``' order)."""
    if task.fewshot_cfg.split is not None:
        return f"its fewshot split '{task.fewshot_cfg.split}'"
    if task.config.fewshot_config is not None and task.fewshot_cfg.samples is not None:
        return "its fewshot_config samples list"
    for kind in ("training", "validation", "test"):
        split = getattr(task.config, f"{kind}_split")
        if split is not None:
            return f"its {kind} split '{split}' (it has no fewshot_split)"
    return "its few-shot documents"


def _draws_as_lm_eval(task) -> bool:
    """Whether ``task`` draws its shots with lm-eval's own samplers (whose bounds
    ``check_fewshot`` knows); a task's own code may draw otherwise."""
    from lm_eval.api.samplers import ContextSampler, FirstNSampler
    from lm_eval.api.task import ConfigurableTask

    sampler = getattr(task, "sampler", None)
    return (isinstance(task, ConfigurableTask)
            and type(task).fewshot_context is ConfigurableTask.fewshot_context
            and getattr(type(sampler), "sample", None) in (ContextSampler.sample,
                                                           FirstNSampler.sample))


def check_fewshot(loaded: list, num_fewshot: Optional[int]) -> None:
    """ConfigError naming the first task (of ``loaded``, groups opened) whose few-shot
    documents are fewer than its shots: lm-eval found it only while building the
    requests, after the model had loaded, as random.sample's traceback. When the shots
    come from the evaluated split (``fewshot_split == test_split``), lm-eval draws one
    more and drops the evaluated document: that split must hold more than the shots."""
    from lm_eval.api.group import Group

    for task in (t for item in loaded for t in
                 (item.get_all_tasks() if isinstance(item, Group) else [item])):
        try:  # lm-eval's task internals (tested on 0.4.13): another version's, unread
            shots, asked = _shots(task, num_fewshot)
            if shots <= 0 or not _draws_as_lm_eval(task):
                continue
            aside = task.fewshot_cfg.split == task.config.test_split  # lm-eval's own test
            have = max(len(task.sampler.fewshot_docs()) - int(aside), 0)
        except AttributeError:
            continue  # left to lm-eval
        if shots > have:
            besides = " besides the evaluated example" if aside else ""
            raise ConfigError(f"task '{task.config.task}': {asked} needs {shots} few-shot "
                              f"examples, {_fewshot_source(task)} has {have}{besides}")


def trusts_remote_code(hf_dir: Path, allow: bool = False) -> bool:
    """Whether lm-eval may run the folder's own code (config.json's ``auto_map``).

    kvtrain's KV-shift export ships its modeling code: a folder kvtrain exported
    (its record present, the auto_map naming kvtrain's modeling classes) runs it.
    Code in any other folder is arbitrary code: refused in one line unless
    ``allow`` (``--trust-remote-code``). A stock Llama folder names no code."""
    from kvtrain.hf.export import AUTO_MAP, RECORD

    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{hf_dir}/config.json: cannot read it ({first_line(e)})") from None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return False
    if allow or (auto_map == AUTO_MAP and (Path(hf_dir) / RECORD).is_file()):
        return True
    raise ConfigError(f"{hf_dir}/config.json: its auto_map names code in the folder that "
                      "kvtrain did not export; pass --trust-remote-code to run it")


def prefix_token_of(hf_dir: Path) -> Optional[int]:
    """The token lm-eval puts before a document it scores whole (rolling
    log-likelihood) or a continuation with an empty context. lm-eval takes the
    tokenizer's BOS, which a kvtrain model never saw: its documents follow the
    end-of-document token (EOD, the tokenizer's EOS), as ``kvtrain generate``
    feeds them. A kvtrain export (its record present) gets its EOS id; any
    other folder keeps lm-eval's choice, the one its model was trained with.
    A run that kept documents apart predicted a document's first token at the
    previous document's EOD too: ``language_model`` scores that EOD alone."""
    from kvtrain.hf.export import RECORD

    if not (Path(hf_dir) / RECORD).is_file():
        return None
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((Path(hf_dir) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, list):  # transformers allows several stop ids: EOD comes first
            eos = eos[0] if eos else None
        if isinstance(eos, int) and not isinstance(eos, bool):
            return eos
    return None


def language_model(hf_dir: Path, spec: EvalSpec, trust: bool, loaded: Optional[list] = None):
    """lm-eval's model of ``hf_dir``. A kvtrain export whose config.json records
    ``reset_attention_mask`` (training kept packed documents apart) scores a row
    that starts with the prefix EOD as two documents, as training saw them: the
    EOD alone predicts the first token (the previous document's EOD attended only
    to its own document), the rest is the document alone (it attended to and
    shifted with nothing before it; ``kvtrain generate`` feeds it so). The model
    code cannot separate documents inside a row (``kvtrain.hf.export``)."""
    from lm_eval.models.huggingface import HFLM

    eod = prefix_token_of(hf_dir)
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    apart = (eod is not None and isinstance(config, dict)
             and config.get("reset_attention_mask") is True)

    class CheckedLM(HFLM):  # a continuation lm-eval cannot score: one line, not its assert
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            check_requests(self, requests, loaded)  # ``loaded``: the tasks, for FILE:LINE
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    class DocumentsApartLM(CheckedLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            logits = super()._model_call(inps, attn_mask, labels)
            first = inps[:, 0] == eod  # the prefix: a text never encodes to EOD
            if labels is None and inps.shape[1] > 1 and bool(first.any()):
                logits[first, 1:] = super()._model_call(inps[first, 1:])
            return logits

    # logits_cache=False: lm-eval 0.4.13 scores requests whose context + continuation[:-1]
    # coincide from one forward, but gathers a shorter continuation's log-probs at the
    # longer one's first positions (wrong log-likelihoods, e.g. winogrande-like pairs)
    return (DocumentsApartLM if apart else CheckedLM)(
        pretrained=str(hf_dir), device=spec.device, dtype=DTYPES[spec.dtype],
        batch_size=spec.batch_size, logits_cache=False, trust_remote_code=trust,
        prefix_token_id=eod, max_length=window_of(hf_dir, spec.max_length)[0])


def _loaded_model(hf_dir: Path, spec: "EvalSpec", trust: bool, loaded: list):
    """``language_model``, with a folder whose weights are missing or damaged (a
    copy cut short) one line naming it, not transformers' traceback."""
    from safetensors import SafetensorError

    try:
        return language_model(hf_dir, spec, trust, loaded)
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{hf_dir}: cannot load its model ({first_line(e)})") from None


def metrics_of(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """lm-eval's ``{task: {"acc,none": v, "alias": ...}}`` -> ``{task: {"acc": v}}``
    (numbers only; a filter other than ``none`` stays in the name: ``acc/<filter>``)."""
    out = {}
    for task, values in results.items():
        metrics = {}
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            metrics[metric if filt == "none" else f"{metric}/{filt}"] = float(value)
        out[task] = metrics
    return out


def _sample_record(task: str, sample: dict) -> dict:
    """One evaluated example: its requests (context, continuation) and the
    model's answers (log-likelihood, is-greedy) in request order."""
    return {"task": task, "doc_id": sample.get("doc_id"), "target": sample.get("target"),
            "arguments": [list(a) if isinstance(a, (list, tuple)) else a
                          for a in sample.get("arguments", [])],
            "resps": sample.get("resps"), "filtered_resps": sample.get("filtered_resps")}


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run_harness(hf_dir: Path, spec: EvalSpec,
                loaded: Optional[tuple[Any, list]] = None) -> EvalOutput:
    """Evaluates the Hugging Face folder ``hf_dir`` on ``spec.tasks`` (``loaded``:
    what ``load_tasks`` returned for them, when already called)."""
    lm_eval = import_harness()
    trust = trusts_remote_code(hf_dir, spec.trust_remote_code)  # refused: before anything
    # the tasks before the model: a refused task costs nothing
    manager, tasks = loaded or load_tasks(spec.tasks, spec.include_path)
    check_fewshot(tasks, spec.num_fewshot)  # lm-eval's refusal came after the model loaded
    check_documents(tasks, spec.limit)  # lm-eval scored them wrong without a word
    lm = _loaded_model(hf_dir, spec, trust, tasks)
    answer = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=spec.num_fewshot, limit=spec.limit,
        task_manager=manager, bootstrap_iters=spec.bootstrap_iters,
        log_samples=spec.log_samples, random_seed=spec.seed, numpy_random_seed=spec.seed,
        torch_random_seed=spec.seed, fewshot_random_seed=spec.seed)
    samples = [_sample_record(task, s) for task, items in (answer.get("samples") or {}).items()
               for s in items]
    return EvalOutput(
        tasks=metrics_of(answer["results"]),
        n_samples={t: int(n.get("effective", 0)) if isinstance(n, dict) else int(n)
                   for t, n in (answer.get("n-samples") or {}).items()},
        n_shot={t: int(k) for t, k in (answer.get("n-shot") or {}).items()},
        versions=_json_safe(answer.get("versions") or {}),
        samples=_json_safe(samples),
        lm_eval_version=getattr(lm_eval, "__version__", ""), max_length=int(lm.max_length))


__all__ = ["EvalOutput", "EvalSpec", "UnknownTask", "check_fewshot", "import_harness",
           "language_model", "load_tasks", "metrics_of", "prefix_token_of", "run_harness",
           "task_manager", "trusts_remote_code"]
