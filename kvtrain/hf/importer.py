"""``kvtrain import hf``: a Llama folder (stock, or a kvtrain KV-shift export) ->
a kvtrain checkpoint that loads at any layout and that a run can start from.

The kvtrain config of the import: the architecture comes from the folder's
config.json (``model_config``); the other model keys and the other sections
come from ``--config`` (the training YAML the run will use, so that the resume
compares equal) or the defaults; ``--set`` applies last, in the trainer's
grammar, e.g. ``--set model.attention=kv_shift`` to add KV shifting to a stock
Llama. Coefficients that the folder lacks start as the paper initialises them
(``kv_shift.initial_parameter``, drawn when the model is built); a KV-shift
folder imported with other shift options than it was exported with is refused,
and options its ``kv_shift`` omits are those its modeling code fills in
(``DEFAULT_KV_SHIFT``). An export's ``reset_attention_mask`` becomes
``data.reset_attention_mask`` unless the config or ``--set`` names that key; its
``eos_token_id`` becomes ``data.eod_id`` (what ``kvtrain generate`` feeds before a
prompt and stops at) unless ``--config`` is given or ``--set`` names a tokenizer or
an EOD; on the same terms its ``tokenizer.model`` (sentencepiece, as the export
writes it) is copied into the checkpoint and becomes ``data.tokenizer``.

The checkpoint (``save_weights``) is megatron dist_checkpointing's torch_dist
format, written like the trainer's (``iter_*.incomplete``, then the marker with
its manifest, then the rename): ``kvtrain.train.integrity`` accepts it,
``load_model`` loads it at any TP/PP, and a run starts from it with
``checkpoint.resume: PATH`` and ``checkpoint.load_optimizer: false``. It holds
the weights, iteration 0 and the config; no optimizer state and no RNG states
(its saved layout is null, so the trainer does not look for them).

The loss of an imported model: kvtrain's loss is megatron's cross-entropy over
the padded vocabulary (``make_vocab_size_divisible_by`` x TP rows), and the
padded rows of the embedding and output layer are imported as zeros, so every
token's softmax also holds (padded - vocab) logits of 0. The first losses are
therefore above the Hugging Face loss, by log(1 + (padded - vocab) / sum(exp(
logits))) per token: about ln(padded / vocab) while the logits are near zero
(0.25 for 100 -> 128), less when they are large; training pushes the padding
logits down. Evaluation (export, ``kvtrain eval``) cuts the padding and is exact.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from kvtrain.config import ConfigError, RunConfig, apply_override, first_line, \
    from_dict, read_yaml, to_dict
from kvtrain.tasks.config import TASK_TYPES

TOKENIZER = "tokenizer.model"  # an export's sentencepiece model (kvtrain.hf.tokenizer)
# architecture keys: what the HF folder decides (``--set`` may not change them)
ARCHITECTURE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "vocab_size", "max_position_embeddings", "position_embedding",
                "rotary_base", "norm_epsilon", "untie_embeddings")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing (not a Hugging Face model folder)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable: {first_line(e)}") from None


# the sizes a Llama config.json must give, each a positive whole number
REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                  "vocab_size", "max_position_embeddings")


def _check_sizes(hf: dict, where: str) -> None:
    """config.json an object with its sizes whole and positive: a missing one was a
    KeyError traceback, a string a TypeError, a list an AttributeError."""
    for key in REQUIRED_SIZES + ("num_key_value_heads", "head_dim"):
        value = hf.get(key)
        if value is None and key not in REQUIRED_SIZES:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}: {key} must be a positive whole number, got {value!r}")
    for key in ("rope_theta", "rms_norm_eps"):
        value = hf.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not 0 < value < float("inf")):
            raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}")


def model_config(hf: dict, where: str) -> dict:
    """The kvtrain ``model`` section (a dict) of a HF Llama config.json."""
    if not isinstance(hf, dict):  # a list: an AttributeError traceback
        raise ConfigError(f"{where}: not a JSON object of model settings")
    kind = hf.get("model_type")
    if kind not in ("llama", "kvshift_llama"):
        raise ConfigError(f"{where}: model_type {kind!r} is not a Llama (llama, kvshift_llama)")
    _check_sizes(hf, where)
    # transformers' order (RotaryEmbeddingConfigMixin): a rope_scaling (4.x's key, and
    # what context-extension recipes add) replaces the rope_parameters 5.x writes
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: rope_parameters / rope_scaling {rope!r} is not an object")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: RoPE scaling {rope.get('rope_type', rope.get('type'))!r} "
                          "is not supported (kvtrain has plain RoPE)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"{where}: biases in attention or MLP are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {hf.get('hidden_act')!r} is not SwiGLU (silu)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    # a string, NaN or a huge base was a ValueError / OverflowError traceback below; the
    # sign is the model config's check (named by config.json's key in import_config)
    name = _hf_key(hf, "rotary_base")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not math.isfinite(theta):
        raise ConfigError(f"{where}: {name} must be a finite number, got {theta!r}")
    if abs(theta) >= 2 ** 63:
        raise ConfigError(f"{where}: {name} {theta} is too large (megatron's RoPE base is an int64)")
    if float(theta) != int(theta):  # megatron's rotary_base is an int: it would truncate it
        raise ConfigError(f"{where}: rope_theta {theta} is not a whole number (megatron's RoPE "
                          "base is an int)")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, hidden // heads):
        raise ConfigError(f"{where}: head_dim {hf['head_dim']} != hidden_size / heads")
    model = {
        "num_layers": hf["num_hidden_layers"], "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "position_embedding": "rope",  # a Llama rotates Q and K (the export refuses none)
        "rotary_base": int(theta),
        "norm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "untie_embeddings": not hf.get("tie_word_embeddings", False),
        "attention": "vanilla",
    }
    if kind == "kvshift_llama":
        # options the folder omits are what its exported code computes with
        from .remote.modeling_kvshift_llama import DEFAULT_KV_SHIFT

        given = hf.get("kv_shift") or {}
        if not isinstance(given, dict):
            raise ConfigError(f"{where}: kv_shift {given!r} is not a mapping of shift options")
        model["attention"] = "kv_shift"
        model["kv_shift"] = {k: given.get(k, DEFAULT_KV_SHIFT[k])
                             for k in ("shift", "window", "mode")}
    return model


# the model keys import_config takes from config.json, by their config.json key
HF_KEYS = {"num_layers": "num_hidden_layers", "num_query_groups": "num_key_value_heads",
           "ffn_hidden_size": "intermediate_size", "rotary_base": "rope_theta",
           "norm_epsilon": "rms_norm_eps", "untie_embeddings": "tie_word_embeddings",
           **{k: k for k in ("hidden_size", "num_attention_heads", "vocab_size",
                             "max_position_embeddings")},
           **{f"kv_shift.{k}": f"kv_shift.{k}" for k in ("shift", "window", "mode")}}


def _hf_key(hf: dict, key: str) -> str:
    """config.json's name for model ``key`` (RoPE's base where the folder keeps it)."""
    if key == "rotary_base":  # the object model_config read the base from
        rope = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        if isinstance(hf.get(rope), dict) and "rope_theta" in hf[rope]:
            return f"{rope}.rope_theta"
    return HF_KEYS[key]


def _hf_value(hf: dict, name: str):
    node = hf
    for part in name.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "unset" if node is None else node


def _named_by_config_json(e: ConfigError, hf: dict, where: str, arch: dict,
                          model: dict) -> ConfigError:
    """``e`` naming config.json's keys behind the model keys it names: the user wrote
    those, never ``model.rotary_base``. Keys ``--config`` / ``--set`` changed stay as
    they are (the refusal is theirs)."""
    def value(key):
        node, ours = model, arch
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
            ours = ours.get(part) if isinstance(ours, dict) else None
        return node if node == ours and ours is not None else None

    named = list(dict.fromkeys(re.findall(r"model\.([A-Za-z_][\w.]*\w)", str(e))))
    keys = [k for k in named if k in HF_KEYS and value(k) is not None]
    if not keys:
        return e
    sources = ", ".join(f"{_hf_key(hf, k)} {_hf_value(hf, _hf_key(hf, k))} gives model.{k} "
                        f"{value(k)}" for k in keys)
    text = str(e)
    if named == keys[:1] and text.startswith(f"model.{keys[0]} "):
        text = text[len(f"model.{keys[0]} "):]  # said in the sources already
    return ConfigError(f"{where}: {sources}: {text}")


def import_config(hf: dict, where: str, config: Optional[str | Path] = None,
                  overrides: Iterable[str] = (),
                  tokenizer: Optional[Callable[[], Optional[str]]] = None) -> RunConfig:
    """The RunConfig of an import: ``config`` (a training YAML) or the defaults,
    with the model architecture of ``hf``, then ``overrides``. ``tokenizer`` is
    asked for the folder's tokenizer (the ``data.tokenizer`` path, or None) where
    neither ``config`` nor ``overrides`` decide the tokenizer or the EOD."""
    data = read_yaml(config) if config is not None else {}
    arch = model_config(hf, where)
    model = dict(data.get("model") or {})
    if arch["attention"] == "vanilla" and model.get("attention") == "kv_shift":
        del arch["attention"]  # a stock Llama getting KV shift from the training config
    if "kv_shift" in arch:  # an export: its shift options are those of its weights
        model["kv_shift"] = {**(model.get("kv_shift") or {}), **arch.pop("kv_shift")}
    for key in ARCHITECTURE:  # what the training config says, the weights must be
        if model.get(key) is not None and model[key] != arch[key]:
            raise ConfigError(f"{config}: model.{key} ({model[key]}) differs from {where} "
                              f"({arch[key]}): the weights decide the architecture (leave "
                              "it out of the config, or give the folder's)")
    model.update(arch)
    data["model"] = model
    # a Llama's context: what a run continuing it trains on unless the config says otherwise
    data.setdefault("train", {}).setdefault("seq_length", arch["max_position_embeddings"])
    for assignment in overrides:
        apply_override(data, assignment, RunConfig)
    _documents_from(hf, data, configured=config is not None, tokenizer=tokenizer)
    try:
        cfg = from_dict(RunConfig, data, source=str(config) if config else None)
        cfg.validate()
    except ConfigError as e:
        raise _named_by_config_json(e, hf, where, model_config(hf, where),
                                    data["model"]) from None
    decided = model_config(hf, where)
    for key in ARCHITECTURE:
        value = getattr(cfg.model, key) if key != "num_query_groups" else cfg.model.kv_heads
        if value != decided[key]:
            raise ConfigError(f"model.{key} ({value}) differs from {where} ({decided[key]}): "
                              "the weights decide the architecture")
    if decided["attention"] == "kv_shift":
        ks, saved = cfg.model.kv_shift, decided["kv_shift"]
        if cfg.model.attention != "kv_shift" or \
                (list(ks.shift), ks.window, ks.mode) != (saved["shift"], saved["window"], saved["mode"]):
            raise ConfigError(f"{where} holds KV-shift weights ({saved}); the import must keep "
                              "model.attention kv_shift with these model.kv_shift options")
    return cfg


def _documents_from(hf: dict, data: dict, configured: bool,
                    tokenizer: Optional[Callable[[], Optional[str]]] = None) -> None:
    """An export's ``reset_attention_mask`` (documents kept apart in training, the EOD
    being ``eos_token_id``) where ``data`` (the config and ``--set``) does not decide:
    what ``kvtrain generate`` reads (no EOD before a prompt) and what a run continuing
    the model trains with. Its tokenizer (``tokenizer()``), else its EOD, too where no
    ``--config`` decides the data (``configured``) and ``--set`` names no tokenizer or
    EOD: the defaults' EOD, the vocabulary's last id, is the model's only by chance,
    and text prompts need the tokenizer. A toy task has one sequence per sample and
    no tokenizer: not given."""
    d = data.get("data") or {}
    if d.get("type") in TASK_TYPES:
        return
    if not configured and tokenizer is not None and "tokenizer" not in d and "eod_id" not in d:
        d["tokenizer"] = tokenizer()
    if "reset_attention_mask" in hf and "reset_attention_mask" not in d:
        d["reset_attention_mask"] = bool(hf["reset_attention_mask"])
        if d["reset_attention_mask"] and d.get("tokenizer") is None and d.get("eod_id") is None:
            d["eod_id"] = hf.get("eos_token_id")
    eos = _end_of_document(hf)
    if not configured and eos is not None and eos != hf["vocab_size"] - 1 and \
            d.get("tokenizer") is None and "eod_id" not in d:
        d["eod_id"] = eos
    data["data"] = d


def _end_of_document(hf: dict) -> Optional[int]:
    """config.json's ``eos_token_id`` where it is one token of the vocabulary: the EOD
    ``kvtrain generate`` feeds before a prompt and stops at (without it, the
    vocabulary's last id: an export of a run whose EOD was another, a tokenizer's EOS
    or ``data.eod_id``, generated other tokens once imported)."""
    eos = hf.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < hf["vocab_size"]:
        return eos
    return None


def _readable_tokenizer(source: Path, hf: dict, carried: Path) -> Optional[str]:
    """``carried`` (the path of the checkpoint's copy) where the folder holds a
    sentencepiece ``source`` that kvtrain reads as the model's (its pieces within
    ``vocab_size``, its EOS the folder's ``eos_token_id``); None, with one warning,
    where it holds another (a stock Llama 3 keeps tiktoken's, elsewhere)."""
    if not source.is_file():
        return None
    from data_tools.tokenizer import SentencePieceTokenizer

    try:
        tok = SentencePieceTokenizer(str(source))
    except (OSError, RuntimeError, ValueError) as e:
        why = str(e).removeprefix(f"{source}: ")
    else:
        eos = hf.get("eos_token_id")
        if tok.vocab_size > hf["vocab_size"]:
            why = f"its {tok.vocab_size} pieces are more than vocab_size {hf['vocab_size']}"
        elif isinstance(eos, int) and tok.eod != eos:
            why = f"its EOS {tok.eod} is not the folder's eos_token_id {eos}"
        else:
            return str(carried)
    print(f"kvtrain: warning: {source} is left out of the import ({why}): kvtrain generate "
          "on it takes --tokenizer", file=sys.stderr)
    return None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (one file, or an index's shards)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            weights.update(load_file(str(path)))
        except Exception as e:  # a damaged file: name it in one line
            raise ConfigError(f"{path}: cannot read it ({first_line(e)})") from None
    return {k: v.float() for k, v in weights.items()}


def save_weights(model: torch.nn.Module, cfg: RunConfig, path: Path,
                 record: Optional[dict] = None, files: Optional[dict[str, Path]] = None) -> Path:
    """Saves ``model`` (this rank's shard; collective over the current layout) as a
    weights-only kvtrain checkpoint folder ``path`` (which must not exist), with
    copies of ``files`` (name in the folder: source), in its manifest."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from data_tools.fileio import atomic_write_text, fsync_dir
    from kvtrain.train.checkpoint import (
        FORMAT_VERSION, SHARDING_METADATA, TrainState, ensure_writer_queue,
    )
    from kvtrain.train.integrity import INCOMPLETE, MARKER, build_manifest, own_shards

    path = Path(path).absolute()
    work = path.with_name(path.name + INCOMPLETE)
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    dist.barrier()
    ensure_writer_queue(False)
    state = {"model": model.sharded_state_dict(metadata=dict(SHARDING_METADATA)),
             "kvtrain": {"state": asdict(TrainState()), "layout": None, "config": to_dict(cfg),
                         "version": FORMAT_VERSION, "weights_only": True, **(record or {})}}
    dist_checkpointing.save(state, str(work), content_metadata={"kvtrain_format": FORMAT_VERSION})
    dist.barrier()
    checksums = [None] * dist.get_world_size()
    dist.all_gather_object(checksums, own_shards(work, rank))
    if rank == 0:
        for name, source in (files or {}).items():
            shutil.copyfile(source, work / name)
        known = {k: v for part in checksums for k, v in part.items()}
        info = {"iteration": 0, "consumed_samples": 0, "layout": None, "format": "torch_dist",
                "version": FORMAT_VERSION, "weights_only": True, **(record or {}),
                "manifest": build_manifest(work, known)}
        atomic_write_text(work / MARKER, json.dumps(info, indent=1) + "\n")
        os.replace(work, path)
        fsync_dir(os.fspath(path.parent))
    dist.barrier()
    return path


def build_from_hf(cfg: RunConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A TP=1 kvtrain model of ``cfg`` holding ``weights`` (HF names); the shift
    coefficients the weights lack keep their initial values."""
    from kvtrain.model.builder import build_gpt, transformer_config

    from .names import from_hf

    model = build_gpt(cfg.model, transformer_config(cfg.model), seed=cfg.train.seed,
                      backend="local")
    state = from_hf(weights, cfg.model)
    own = model.state_dict()
    for name, value in state.items():
        if name not in own:
            raise ConfigError(f"the weight {name} has no place in the model of the import config")
        if tuple(own[name].shape) != tuple(value.shape):
            raise ConfigError(f"the weight {name} has shape {tuple(value.shape)}, the model "
                              f"{tuple(own[name].shape)}")
    model.load_state_dict(state, strict=False)
    missing = [k for k in own if k not in state and not k.endswith("_extra_state")
               and not k.split(".")[-1].startswith("shift_")]
    if missing:
        raise ConfigError(f"the Hugging Face weights lack {', '.join(missing[:6])}")
    return model


def _warn_of_an_unused_lm_head(weights: dict[str, torch.Tensor], cfg: RunConfig,
                               config_json: Path) -> None:
    """One line on stderr when tied embeddings leave a distinct ``lm_head.weight`` of the
    folder unused (transformers ties them too, without a word)."""
    head, embed = weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
    if cfg.model.untie_embeddings or head is None or embed is None or torch.equal(head, embed):
        return
    print(f"kvtrain: warning: {config_json} ties the embeddings (tie_word_embeddings: true) "
          "but its weights hold an lm_head.weight that differs from model.embed_tokens.weight: "
          "it is left out and the output layer is the embedding, as transformers loads the "
          "folder", file=sys.stderr)


def import_hf(hf_dir: str | Path, out_checkpoint: str | Path, config: Optional[str | Path] = None,
              overrides: Iterable[str] = ()) -> Path:
    """Imports the Llama folder ``hf_dir`` as the kvtrain checkpoint
    ``out_checkpoint`` (a new folder); returns it. One process, CPU."""
    from . import offline, require_hf

    require_hf("kvtrain import")
    offline()
    from kvtrain.inference.loading import inference_process

    hf_dir = Path(hf_dir).expanduser()
    out = Path(out_checkpoint).expanduser().absolute()
    if out.exists():
        raise ConfigError(f"{out} exists: the import writes a new checkpoint folder")
    hf = _read_json(hf_dir / "config.json")
    carried = out / TOKENIZER
    cfg = import_config(hf, str(hf_dir / "config.json"), config, overrides,
                        tokenizer=lambda: _readable_tokenizer(hf_dir / TOKENIZER, hf, carried))
    weights = read_weights(hf_dir)
    _warn_of_an_unused_lm_head(weights, cfg, hf_dir / "config.json")
    inference_process(seed=cfg.train.seed)
    model = build_from_hf(cfg, weights)
    record = {"imported_from": str(hf_dir.absolute())}
    export_record = hf_dir / "kvtrain_export.json"
    if export_record.is_file():
        source = _read_json(export_record)
        record["exported_from"] = {k: source.get(k) for k in ("checkpoint", "iteration", "run_dir")}
    from torch.distributed.checkpoint.api import CheckpointException

    from kvtrain.train.integrity import INCOMPLETE, save_failure_reason

    try:
        files = {TOKENIZER: hf_dir / TOKENIZER} if cfg.data.tokenizer == str(carried) else {}
        return save_weights(model, cfg, out, record, files)
    except (OSError, RuntimeError, CheckpointException) as e:  # torch's is a BaseException
        # a full disk is torch.save's "unexpected pos 704 vs 598": the trainer's reading
        reason = save_failure_reason(e, out.parent)
        shutil.rmtree(out.with_name(out.name + INCOMPLETE), ignore_errors=True)
        raise ConfigError(f"import to {out} failed: {reason}") from None


__all__ = ["build_from_hf", "import_config", "import_hf", "model_config", "read_weights",
           "save_weights"]
