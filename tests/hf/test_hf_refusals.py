"""What ``kvtrain import hf`` / ``kvtrain export hf`` refuse, each in one line, and
what a refusal leaves behind: nothing (no checkpoint folder, no ``.incomplete``,
no half-written export folder).

The inputs are one tiny exported folder and one tiny checkpoint per module,
copied and edited per case (a config.json key changed, a tensor dropped, added
or reshaped)."""

from __future__ import annotations

import json
import resource
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtrain.cli import main
from kvtrain.config import ConfigError
from kvtrain.hf.export import export_hf, export_model
from kvtrain.hf.importer import import_hf, save_weights

from .helpers import build, model_config, run_config


@pytest.fixture(scope="module")
def made(single_rank, tmp_path_factory):
    """A one-layer KV-shift model (untied, GQA 4 heads / 2 KV heads, ffn 64) as an
    exported Hugging Face folder ``hf``, and as checkpoints: ``ckpt`` (no tokenizer)
    and ``ckpt-tok`` (its data.tokenizer ``gone/tok.model``, which is nowhere)."""
    from kvtrain.backend import init_model_parallel

    init_model_parallel(1, 1)
    root = tmp_path_factory.mktemp("hf-refusals")
    cfg = run_config(model_config(num_layers=1))
    model = build(cfg)
    (root / "hf").mkdir()
    export_model(model, cfg, root / "hf")
    save_weights(model, cfg, root / "ckpt" / "iter_0000000")
    cfg.data.tokenizer = "gone/tok.model"
    save_weights(model, cfg, root / "ckpt-tok" / "iter_0000000")
    return root


def edited(source: Path, folder: Path, config: dict | None = None, weights=None) -> Path:
    """A copy of the Hugging Face folder ``source`` with ``config`` merged into its
    config.json (a None value removes the key) and ``weights(dict)`` applied to its
    tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    if config:
        data = json.loads((folder / "config.json").read_text())
        data.update(config)
        data = {k: v for k, v in data.items() if v is not None}
        (folder / "config.json").write_text(json.dumps(data))
    if weights:
        tensors = load_file(str(folder / "model.safetensors"))
        weights(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(folder / "model.safetensors"))
    return folder


@contextmanager
def small_files(limit: int = 4096):
    """Files of this process cannot grow past ``limit`` bytes (a full disk, a
    quota): a write beyond fails with EFBIG ("File too large") instead of SIGXFSZ."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ----------------------------------------------------------------------------- import
def test_config_json_kvtrain_cannot_read_is_one_line(made, tmp_path, capsys):
    """config.json that is not JSON, a rope_parameters that is not an object (a
    string), a kvshift_llama's kv_shift that is not a mapping (a list of what it
    shifts): each names config.json and the key, before the weights are read."""
    cases = {
        "not-json": (None, "is unreadable: JSONDecodeError: "),
        "rope": ({"rope_parameters": "default"},
                 "rope_parameters / rope_scaling 'default' is not an object"),
        "kv_shift": ({"kv_shift": ["k", "v"]},
                     "kv_shift ['k', 'v'] is not a mapping of shift options"),
    }
    for name, (change, message) in cases.items():
        folder = edited(made / "hf", tmp_path / name, change)
        if change is None:
            (folder / "config.json").write_text('{"model_type": "llama",')
        with pytest.raises(ConfigError) as e:
            import_hf(folder, tmp_path / f"{name}-ckpt")
        assert str(e.value).startswith(f"{folder / 'config.json'}") and message in str(e.value)
        assert "\n" not in str(e.value), name
    # the command: one line, exit 2
    assert main(["import", "hf", str(tmp_path / "rope"), str(tmp_path / "cli-ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rope_parameters / rope_scaling 'default'" in err
    assert not [n for n in left(tmp_path) if n.endswith("ckpt")]


LAYER = "model.layers.0."


def _drop(name):
    return lambda w: w.pop(name)


def _add(name, like):
    return lambda w: w.__setitem__(name, w[like].clone())


def _transpose(name):
    return lambda w: w.__setitem__(name, w[name].T)


WEIGHT_CASES = {
    # a tensor the model needs is not in the folder
    "no-norm": (None, _drop("model.norm.weight"),
                "the Hugging Face weights have no model.norm.weight"),
    # config.json unties the embeddings, the folder has no output layer
    "no-lm-head": (None, _drop("lm_head.weight"),
                   "the Hugging Face weights have no lm_head.weight but the model has untied "
                   "embeddings (model.untie_embeddings: true)"),
    # a Qwen3-style QK norm: a weight a Llama has no place for
    "qk-norm": (None, _add(f"{LAYER}self_attn.q_norm.weight", "model.norm.weight"),
                f"unknown Hugging Face weights: {LAYER}self_attn.q_norm.weight"),
    # a tensor stored transposed
    "transposed": (None, _transpose(f"{LAYER}mlp.down_proj.weight"),
                   "the weight decoder.layers.0.mlp.linear_fc2.weight has shape (64, 32), "
                   "the model (32, 64)"),
    # a KV-shift folder whose config.json was made a stock Llama's: its shift weights
    "llama-with-shifts": ({"model_type": "llama", "auto_map": None, "kv_shift": None}, None,
                          "the weight decoder.layers.0.self_attention.shift_k has no place in "
                          "the model of the import config"),
    # config.json's sizes not those of the weights: were reshape / cat tracebacks
    # (no num_key_value_heads: as many KV heads as heads, the MHA of older configs)
    "kv-heads": ({"num_key_value_heads": None}, None,
                 f"the Hugging Face weight {LAYER}self_attn.k_proj.weight has shape (16, 32), "
                 "config.json makes it (32, 32)"),
    "ffn": ({"intermediate_size": 128}, None,
            f"the Hugging Face weight {LAYER}mlp.gate_proj.weight has shape (64, 32), "
            "config.json makes it (128, 32)"),
}


@pytest.mark.parametrize("case", sorted(WEIGHT_CASES))
def test_weights_that_do_not_fit_the_model_are_one_line(made, tmp_path, case):
    """Weights missing, unknown, of another shape than config.json makes them, or
    without a place in the model: one line naming the weight; no checkpoint."""
    change, weights, message = WEIGHT_CASES[case]
    folder = edited(made / "hf", tmp_path / "hf", change, weights)
    with pytest.raises(ConfigError) as e:
        import_hf(folder, tmp_path / "ckpt")
    assert str(e.value) == message
    assert left(tmp_path) == ["hf"]


def test_an_import_that_cannot_be_written_is_one_line_and_leaves_nothing(made, tmp_path, capsys):
    """The checkpoint cannot be written: a file where its folder should be, or a
    full disk (files that cannot grow). The full disk was a RuntimeError traceback
    from torch.save ("unexpected pos ...") that left OUT.incomplete behind."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=f"^import to {blocker / 'ckpt'} failed: "):
        import_hf(made / "hf", blocker / "ckpt")
    out = tmp_path / "ckpt"
    with small_files(), pytest.raises(ConfigError) as e:
        import_hf(made / "hf", out)
    assert str(e.value) == f"import to {out} failed: File too large"
    assert left(tmp_path) == ["file"]


# ----------------------------------------------------------------------------- export
def test_an_export_whose_run_tokenizer_is_gone_is_one_line(made, tmp_path):
    """The run's data.tokenizer is neither where the config says nor beside the run:
    refused in one line, the export folder not made (nor its temporary)."""
    with pytest.raises(ConfigError, match="^data.tokenizer gone/tok.model \\(the run's "
                                          "tokenizer\\) is not there: the export needs it"):
        export_hf(made / "ckpt-tok", tmp_path / "hf")
    assert left(tmp_path) == []


def test_export_under_torchrun_is_refused(made, tmp_path, capsys, monkeypatch):
    """``torchrun ... kvtrain export hf``: every rank would load and write the same
    export. The check looked only at an initialised process group, which the
    command has not made yet: it went on (two ranks, two exports)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["export", "hf", str(made / "ckpt"), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == \
        "kvtrain: config error: kvtrain export runs in one process (not under torchrun)\n"
    assert left(tmp_path) == []


def test_an_export_that_cannot_be_written_is_one_line_and_leaves_nothing(made, tmp_path, capsys):
    """A full disk while the weights are written (files that cannot grow): it was a
    SafetensorError traceback; now one line, and no half-written folder."""
    out = tmp_path / "hf"
    with small_files(), pytest.raises(ConfigError) as e:
        export_hf(made / "ckpt", out)
    assert str(e.value).startswith(f"export to {out} failed: ") and "File too large" in str(e.value)
    assert "\n" not in str(e.value) and left(tmp_path) == []


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizers_the_export_cannot_convert_are_one_line(tmp_path):
    """The run's tokenizer is not a sentencepiece model, is a BPE model without byte
    fallback, or converts to a Hugging Face tokenizer that encodes differently (a
    unigram model, NFKC whitespace folding): one line, nothing copied."""
    import sentencepiece as spm

    from kvtrain.hf.tokenizer import export_tokenizer

    lines = [f"the {w} sat on the mat number {i}" for i in range(60) for w in ("cat", "dog")]
    for name, options in (("bpe", dict(model_type="bpe", vocab_size=64)),
                          ("unigram", dict(model_type="unigram", byte_fallback=True,
                                           vocab_size=288))):
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), minloglevel=2,
                                       model_prefix=str(tmp_path / name), **options)
    (tmp_path / "text.model").write_text("not a model\n")
    out = tmp_path / "out"
    out.mkdir()
    for name, message in (
            ("text", "cannot read it (INTERNAL: could not parse ModelProto from "),
            ("bpe", "only byte-fallback BPE models (kvtrain data train-tokenizer) can be "
                    "exported"),
            ("unigram", "the Hugging Face conversion encodes ' two  spaces' differently from "
                        "sentencepiece; not exported")):
        model = tmp_path / f"{name}.model"
        with pytest.raises(ConfigError) as e:
            export_tokenizer(model, out)
        assert str(e.value).startswith(f"tokenizer {model}: {message}"), e.value
        assert "\n" not in str(e.value)
    assert left(out) == []
