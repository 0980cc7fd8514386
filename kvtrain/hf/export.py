"""``kvtrain export hf``: a kvtrain checkpoint -> a Hugging Face model folder.

The checkpoint (any TP/PP/DP layout) is loaded whole into this one CPU process
(``kvtrain.inference.loading.load_model`` reshards it), renamed and re-laid out
(``names.to_hf``) and written as:

* vanilla: a stock ``LlamaForCausalLM`` folder (config.json, model.safetensors,
  generation_config.json), no custom code;
* KV shift: the same Llama names plus ``self_attn.shift_{q,k,v}`` per layer, and
  the remote-code pair ``configuration_kvshift_llama.py`` /
  ``modeling_kvshift_llama.py`` registered in config.json's ``auto_map``
  (``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``);
* the tokenizer files when the run has a sentencepiece tokenizer (``tokenizer``);
* ``kvtrain_export.json``: the checkpoint, run folder, iteration and config it came from.

config.json also says whether the run kept packed documents apart
(``reset_attention_mask``, Megatron-LM's name, with the EOD as ``eos_token_id``).
Neither model honours it inside a row (the stock Llama cannot, and the KV-shift
code keeps to the same input contract): such a model is fed one document per row,
without an EOS before it (see ``modeling_kvshift_llama``).

The folder is written next to ``out_dir`` under a temporary name and renamed
when complete: a failed export leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from kvtrain.config import ConfigError, RunConfig, first_line, one_process_only, to_dict

from . import HF_EXTRA, offline, require_hf  # noqa: F401 (re-exported)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REMOTE = Path(__file__).with_name("remote")
REMOTE_FILES = ("configuration_kvshift_llama.py", "modeling_kvshift_llama.py")
RECORD = "kvtrain_export.json"
# The export's format: raised when what an export writes changes (2: the tokenizer's
# split_special_tokens, config.json's reset_attention_mask), so that kvtrain eval's
# cached exports of an older kvtrain are redone (kvtrain.evaluate.source)
EXPORT_VERSION = 2
AUTO_MAP = {"AutoConfig": "configuration_kvshift_llama.KVShiftLlamaConfig",
            "AutoModelForCausalLM": "modeling_kvshift_llama.KVShiftLlamaForCausalLM"}


def hf_config(cfg: RunConfig, special: dict, dtype: str):
    """The transformers config of the run's model (LlamaConfig, or the KV-shift one)."""
    m = cfg.model
    if m.position_embedding != "rope":
        raise ConfigError(f"model.position_embedding {m.position_embedding!r} has no Llama "
                          "equivalent: only RoPE models can be exported")
    if m.mla is not None:
        raise ConfigError("model.mla: multi-latent attention has no Llama equivalent; the "
                          "export takes standard (MHA/GQA) attention only")
    if m.attention == "kv_shift" and m.kv_shift.heads is not None:
        raise ConfigError("model.kv_shift.heads (shifting selected heads, App. J) is not in the "
                          "exported model code yet: export a run that shifts every head")
    fields = dict(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.kv_heads, head_dim=m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
        tie_word_embeddings=not m.untie_embeddings, hidden_act="silu", attention_bias=False,
        mlp_bias=False, initializer_range=m.init_method_std,
        bos_token_id=special.get("bos"), eos_token_id=special.get("eos"),
        pad_token_id=special.get("pad"), dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
        # how it was trained: true, every packed document attended to and shifted with
        # nothing before it (its EOD is eos_token_id); read back by kvtrain import
        reset_attention_mask=cfg.data.reset_attention_mask)
    if m.attention == "vanilla":
        from transformers import LlamaConfig

        return LlamaConfig(architectures=["LlamaForCausalLM"], **fields)
    from .remote.configuration_kvshift_llama import KVShiftLlamaConfig

    ks = m.kv_shift
    return KVShiftLlamaConfig(
        architectures=["KVShiftLlamaForCausalLM"], auto_map=dict(AUTO_MAP),
        kv_shift={"shift": list(ks.shift), "window": ks.window, "mode": ks.mode}, **fields)


def _tokenizer_path(cfg: RunConfig, checkpoint: Optional[Path]) -> Optional[Path]:
    """The run's sentencepiece model (as configured, or relative to the run folder)."""
    if not cfg.data.tokenizer:
        return None
    from data_tools.tokenizer import resolve_model_path

    named = Path(cfg.data.tokenizer).expanduser()
    tries = [named] + ([p / named for p in checkpoint.parents][:3] if checkpoint else [])
    for path in tries:
        try:
            return Path(resolve_model_path(path))
        except FileNotFoundError:
            continue
    raise ConfigError(f"data.tokenizer {cfg.data.tokenizer} (the run's tokenizer) is not there: "
                      "the export needs it for its tokenizer files")


def _special_ids(cfg: RunConfig, tokenizer: Optional[Path], out: Path) -> dict:
    if tokenizer is not None:
        from .tokenizer import export_tokenizer

        return export_tokenizer(tokenizer, out)
    from kvtrain.data.tokenizer import VocabOnlyTokenizer

    # the end of a document the trainer and kvtrain generate use (data.eod_id, else
    # the last id of the vocabulary), so that HF generate stops where they do
    eod = VocabOnlyTokenizer(cfg.model.vocab_size, cfg.data.eod_id, "export").eod
    return {"bos": None, "eos": eod, "pad": eod, "unk": None}


def export_model(model: torch.nn.Module, cfg: RunConfig, out_dir: Path, dtype: str = "fp32",
                 record: Optional[dict] = None, tokenizer: Optional[Path] = None) -> Path:
    """Writes the HF folder of ``model`` (a whole TP=1/PP=1 GPTModel of ``cfg``)
    into ``out_dir`` (an existing, empty folder). ``record``: what goes into
    kvtrain_export.json besides the config."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from .names import to_hf

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    special = _special_ids(cfg, tokenizer, out_dir)
    config = hf_config(cfg, special, dtype)
    weights = to_hf({k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}, cfg.model)
    weights = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in weights.items()}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out_dir))
    if special.get("eos") is not None:
        GenerationConfig(bos_token_id=special.get("bos"), eos_token_id=special["eos"],
                         pad_token_id=special.get("pad")).save_pretrained(str(out_dir))
    if cfg.model.attention == "kv_shift":
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE / name, out_dir / name)
    info = {"format": "kvtrain-hf-export", "version": EXPORT_VERSION, "dtype": dtype,
            "attention": cfg.model.attention, "exported_at": time.time(), **(record or {}),
            "config": to_dict(cfg)}
    (out_dir / RECORD).write_text(json.dumps(info, indent=1, default=str) + "\n")
    return out_dir


def _check_out_dir(out_dir: Path, force: bool, source: Path) -> None:
    """A non-empty ``out_dir`` is replaced whole, so ``force`` takes only a Hugging
    Face model folder (an earlier export), never one holding the checkpoint
    exported or the current folder: ``export hf RUN RUN --force``, or ``"$OUT"``
    unset, deleted the run, or everything in the current folder."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} exists and is not a folder")
    if not (out_dir.is_dir() and any(out_dir.iterdir())):
        return
    if not force:
        raise ConfigError(f"{out_dir} exists and is not empty (--force replaces an earlier "
                          "export there)")
    real, source = out_dir.resolve(), source.expanduser().resolve()
    for what, inside in (("the checkpoint being exported", source),
                         ("the current folder", Path.cwd().resolve())):
        if inside == real or real in inside.parents:
            raise ConfigError(f"--force would replace {out_dir}, which holds {what}: "
                              "export to another folder")
    if not (out_dir / "config.json").is_file():
        raise ConfigError(f"--force replaces a Hugging Face model folder (an earlier export); "
                          f"{out_dir} holds no config.json: export to another folder, or "
                          "empty it first")


def publish(work: Path, out_dir: Path) -> None:
    """Moves the complete folder ``work`` to ``out_dir`` (replacing what is there)."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(work, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_hf(source: str | Path, out_dir: str | Path, dtype: str = "fp32",
              force: bool = False) -> Path:
    """Exports the checkpoint ``source`` names (a run folder, its checkpoints
    folder or one checkpoint) as a Hugging Face folder ``out_dir``; returns it.

    ``dtype``: fp32 | bf16 weights. Refuses a non-empty ``out_dir`` unless ``force``
    and it is a Hugging Face model folder (``_check_out_dir``).
    Runs in one CPU process; bad input is one ConfigError line.
    """
    require_hf()
    offline()
    import torch.distributed as dist
    from safetensors import SafetensorError

    from kvtrain.inference.loading import inference_process, load_model

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir).expanduser().absolute()
    _check_out_dir(out_dir, force, Path(source))
    one_process_only("kvtrain export")  # before inference_process makes the group
    if dist.is_initialized() and dist.get_world_size() > 1:  # called inside one
        raise ConfigError("kvtrain export runs in one process (not under torchrun)")
    work = _work_folder(out_dir)  # before the checkpoint is loaded
    try:
        inference_process()
        loaded = load_model(source, backend="local", dtype=torch.float32)
        tokenizer = _tokenizer_path(loaded.config, loaded.checkpoint)
        checkpoint = loaded.checkpoint.absolute()
        record = {"checkpoint": str(checkpoint), "iteration": loaded.iteration,
                  "run_dir": str(checkpoint.parent.parent)
                  if checkpoint.parent.name == "checkpoints" else None}
        try:
            export_model(loaded.model, loaded.config, work, dtype, record, tokenizer)
            publish(work, out_dir)
        except (OSError, SafetensorError) as e:  # a full disk under safetensors: its own
            raise ConfigError(f"export to {out_dir} failed: {first_line(e)}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


def _work_folder(out_dir: Path) -> Path:
    """The hidden folder the export is written in (then renamed to ``out_dir``),
    made first: an output that cannot be written (a file in its path, a read-only
    or virtual file system) is one line before the minutes of loading, not a
    traceback after them."""
    from data_tools.fileio import not_a_folder

    if why := not_a_folder(out_dir.parent):
        raise ConfigError(f"cannot export to {out_dir}: {why}")
    work = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
    except OSError as e:
        raise ConfigError(f"cannot export to {out_dir}: {first_line(e)}") from None
    return work


__all__ = ["HF_EXTRA", "export_hf", "export_model", "hf_config", "offline", "require_hf"]
