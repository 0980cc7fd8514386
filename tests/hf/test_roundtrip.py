"""Round trip in one process: kvtrain checkpoint -> export -> import -> the same
logits; the import's config rules; the one-line errors of export and import."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kvtrain.config import ConfigError, ModelConfig, to_dict
from kvtrain.hf.export import export_hf
from kvtrain.hf.importer import import_hf, save_weights
from kvtrain.inference.loading import load_model, saved_config

from .helpers import VOCAB, build, hf_logits, kvtrain_logits, load_hf, model_config, run_config, \
    tokens


@pytest.fixture
def kv_checkpoint(mp1, tmp_path):
    """A weights-only checkpoint of a KV-shift model (window 2, gate), and its logits."""
    from kvtrain.config import KVShiftConfig

    cfg = run_config(model_config(kv_shift=KVShiftConfig(window=2, mode="gate")))
    model = build(cfg)
    path = save_weights(model, cfg, tmp_path / "ckpt" / "iter_0000000")
    return path, kvtrain_logits(model, tokens())


def test_export_import_round_trip(kv_checkpoint, tmp_path):
    path, expected = kv_checkpoint
    out = export_hf(path, tmp_path / "hf")
    record = json.loads((out / "kvtrain_export.json").read_text())
    assert record["checkpoint"] == str(path) and record["iteration"] == 0
    torch.testing.assert_close(hf_logits(load_hf(out), tokens()), expected, atol=1e-4, rtol=1e-4)
    back = import_hf(out, tmp_path / "imported")
    loaded = load_model(back, backend="local")
    assert loaded.config.model.kv_shift.window == 2 and loaded.iteration == 0
    torch.testing.assert_close(kvtrain_logits(loaded.model, tokens()), expected, atol=1e-5, rtol=1e-5)


def test_kv_shift_options_a_folder_omits_are_the_model_codes_defaults(kv_checkpoint, tmp_path):
    """A kvshift_llama config.json naming only some ``kv_shift`` options loads in
    transformers (the exported code fills the rest); the import fills them the same
    way and computes what that model computes."""
    path, _ = kv_checkpoint
    out = export_hf(path, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    config["kv_shift"] = {"shift": ["k", "v"]}  # window 2, gate -> the code's 1, free (same shape)
    (out / "config.json").write_text(json.dumps(config))
    loaded = load_model(import_hf(out, tmp_path / "imported"), backend="local")
    ks = loaded.config.model.kv_shift
    assert (list(ks.shift), ks.window, ks.mode) == (["k", "v"], 1, "free")
    torch.testing.assert_close(kvtrain_logits(loaded.model, tokens()),
                               hf_logits(load_hf(out), tokens()), atol=1e-4, rtol=1e-4)


def test_imported_llamas_loss_counts_the_padded_vocabulary(mp1, tmp_path):
    """kvtrain's loss is megatron's, over the padded vocabulary (100 -> 128 rows
    here); an imported Llama's padded rows are zero, so its loss is the HF
    cross-entropy over the HF logits plus 28 zero logits: above the HF loss, by
    about ln(128/100) while the logits are near zero (documented in import_hf)."""
    import math

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5)).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    loaded = load_model(import_hf(tmp_path / "hf", tmp_path / "ckpt"), backend="local").model
    tok = tokens(2, 12)
    with torch.no_grad():
        hf_loss = float(hf_model(input_ids=tok, labels=tok).loss)
        logits = hf_model(input_ids=tok).logits[:, :-1].double()
        ours = loaded(tok[:, :-1], torch.arange(11)[None].expand(2, 11), None, labels=tok[:, 1:])
    padded = torch.cat([logits, logits.new_zeros(*logits.shape[:2], 128 - VOCAB)], -1)
    expected = torch.nn.functional.cross_entropy(padded.flatten(0, 1), tok[:, 1:].flatten())
    assert float(ours.mean()) == pytest.approx(float(expected), abs=1e-4)
    assert float(ours.mean()) - hf_loss == pytest.approx(math.log(128 / VOCAB), abs=0.01)


def test_bf16_export(kv_checkpoint, tmp_path):
    path, expected = kv_checkpoint
    out = export_hf(path, tmp_path / "hf", dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_stock_llama_gets_kv_shift(mp1, tmp_path):
    """A vanilla export imported with KV shift added: the Llama weights are kept,
    the coefficients start as the paper initialises them."""
    from kvtrain.hf.export import export_model
    from kvtrain.model.kv_shift import KVShiftOptions, initial_parameter

    cfg = run_config(model_config(attention="vanilla"))
    model = build(cfg)
    (tmp_path / "hf").mkdir()
    export_model(model, cfg, tmp_path / "hf")
    back = import_hf(tmp_path / "hf", tmp_path / "ckpt",
                     overrides=["model.attention=kv_shift", "train.seed=5"])
    loaded = load_model(back, backend="local")
    attn = loaded.model.decoder.layers[1].self_attention
    torch.testing.assert_close(attn.shift_k.detach(),
                               initial_parameter(2, KVShiftOptions(seed=5), 2, "k"))
    assert torch.equal(loaded.model.decoder.layers[1].mlp.linear_fc2.weight,
                       model.decoder.layers[1].mlp.linear_fc2.weight)
    cfg_saved, _ = saved_config(back)
    assert cfg_saved.model.attention == "kv_shift" and cfg_saved.train.seed == 5


@pytest.mark.parametrize("attention", ["kv_shift", "vanilla"])
def test_document_separation_is_exported_and_imported(mp1, tmp_path, attention):
    """A run that kept packed documents apart (``data.reset_attention_mask``) made a
    model that never attended or shifted across an end-of-document token: its
    config.json says so (``reset_attention_mask``, the EOD being ``eos_token_id``),
    and the import gives the checkpoint that option and EOD (``kvtrain generate``
    then puts no EOD before a prompt); the training config of the import decides
    for the run that continues it."""
    from kvtrain.hf.export import export_model

    for separated in (True, False):
        cfg = run_config(model_config(attention=attention))
        cfg.data.reset_attention_mask = separated
        out = tmp_path / f"hf-{separated}"
        out.mkdir()
        export_model(build(cfg), cfg, out)
        config = json.loads((out / "config.json").read_text())
        assert config["reset_attention_mask"] is separated
        assert config["eos_token_id"] == VOCAB - 1
        saved, _ = saved_config(import_hf(out, tmp_path / f"ckpt-{separated}"))
        assert saved.data.reset_attention_mask is separated
        assert saved.data.eod_id == (VOCAB - 1 if separated else None)
    back = import_hf(tmp_path / "hf-True", tmp_path / "ckpt-set",
                     overrides=["data.reset_attention_mask=false"])
    assert not saved_config(back)[0].data.reset_attention_mask


def test_one_line_errors(kv_checkpoint, tmp_path):
    path, _ = kv_checkpoint
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        export_hf(path, tmp_path / "full")
    with pytest.raises(ConfigError, match="--dtype"):
        export_hf(path, tmp_path / "o", dtype="fp8")
    assert not (tmp_path / "o").exists()
    out = export_hf(path, tmp_path / "hf")
    with pytest.raises(ConfigError, match="the weights decide"):
        import_hf(out, tmp_path / "a", overrides=["model.num_layers=3"])
    # a Llama rotates Q and K: its weights without RoPE are another function (imported
    # so, unsaid: a probe's)
    with pytest.raises(ConfigError, match=r"^model.position_embedding \(none\) differs "
                                          r"from .*config.json \(rope\): the weights decide"):
        import_hf(out, tmp_path / "a", overrides=["model.position_embedding=none"])
    with pytest.raises(ConfigError, match="KV-shift weights"):
        import_hf(out, tmp_path / "b", overrides=["model.kv_shift.window=1"])
    with pytest.raises(ConfigError, match="config.json is missing"):
        import_hf(tmp_path / "full", tmp_path / "c")
    with pytest.raises(ConfigError, match="exists"):
        import_hf(out, path)
    assert not any((tmp_path / n).exists() for n in ("a", "b", "c"))


def test_weights_only_checkpoint_asks_for_load_optimizer_false(kv_checkpoint):
    """The trainer's load of an imported checkpoint with its optimizer: one line."""
    from kvtrain.train.checkpoint import Checkpointer

    path, _ = kv_checkpoint
    ckpt = Checkpointer(path.parent, [torch.nn.Linear(1, 1)], None, None, {})
    with pytest.raises(ConfigError, match="checkpoint.load_optimizer: false"):
        ckpt.load(path, load_optimizer=True)


def test_cli(kv_checkpoint, tmp_path, capsys, monkeypatch):
    """kvtrain export hf / import hf: exit 0; bad input and a missing extra: one line, exit 2."""
    import importlib.util

    from kvtrain.cli import main

    path, _ = kv_checkpoint
    assert main(["export", "hf", str(path), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    assert main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "back"),
                 "--set", "train.seed=3"]) == 0
    assert saved_config(tmp_path / "back")[0].train.seed == 3
    capsys.readouterr()
    assert main(["export", "hf", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such run folder or checkpoint" in err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    for command in (["export", "hf", str(path), str(tmp_path / "y")],
                    ["import", "hf", str(tmp_path / "hf"), str(tmp_path / "z")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pip install 'kvtrain[hf]'" in err


@pytest.mark.parametrize("model, needle", [
    (dict(mla={"kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 8,
               "v_head_dim": 8}, num_query_groups=None), "model.mla"),
    (dict(kv_shift={"heads": {"k": [0], "v": [1], "fixed": True}}), "model.kv_shift.heads"),
    (dict(position_embedding="none"), "model.position_embedding 'none' has no Llama equivalent"),
])
def test_models_without_an_hf_form_are_refused_in_one_line(model, needle):
    """MLA, the App. J head selection and a model without position embedding (a Llama
    has RoPE) have no exported model code: refused, no folder."""
    from kvtrain.config import from_dict
    from kvtrain.hf.export import hf_config

    cfg = run_config(from_dict(ModelConfig, {**to_dict(model_config()), **model}))
    with pytest.raises(ConfigError, match=needle):
        hf_config(cfg, {}, "fp32")


def test_hf_folders_kvtrain_cannot_take_are_refused_in_one_line(kv_checkpoint, tmp_path):
    """What ``kvtrain import`` refuses in a Hugging Face folder, each named in one line
    before anything is written: another architecture, scaled RoPE (Llama 3.1's), a RoPE
    base megatron would truncate, biases,
    another activation, a head width other than hidden / heads, no weights, a damaged
    weights file."""
    import shutil

    path, _ = kv_checkpoint
    out = export_hf(path, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    rope = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    heads = config["num_attention_heads"]
    cases = {
        "mistral": ({"model_type": "mistral"},
                    "model_type 'mistral' is not a Llama (llama, kvshift_llama)"),
        # (transformers 5 writes rope_parameters, 4 wrote rope_scaling: whichever is there)
        "llama3": ({"rope_parameters" if "rope_parameters" in config else "rope_scaling":
                    {"rope_type": "llama3", "factor": 8.0, "rope_theta": 100000.0}},
                   "RoPE scaling 'llama3' is not supported (kvtrain has plain RoPE)"),
        "theta": ({"rope_parameters" if "rope_parameters" in config else "rope_scaling":
                   {"rope_type": "default", "rope_theta": 10000.5}},
                  "rope_theta 10000.5 is not a whole number (megatron's RoPE base is an int)"),
        "bias": ({"attention_bias": True}, "biases in attention or MLP are not supported"),
        "gelu": ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not SwiGLU (silu)"),
        "head_dim": ({"head_dim": 7}, "head_dim 7 != hidden_size / heads"),
        # a KeyError, a TypeError traceback; the vocabulary padded with zero "tokens"
        "no_heads": ({"num_attention_heads": None},
                     "num_attention_heads must be a positive whole number, got None"),
        "heads_str": ({"num_attention_heads": "4"},
                      "num_attention_heads must be a positive whole number, got '4'"),
        "vocab": ({"vocab_size": config["vocab_size"] + 64},
                  f"the Hugging Face weight model.embed_tokens.weight has {config['vocab_size']} "
                  f"rows, but config.json's vocab_size is {config['vocab_size'] + 64}"),
        "list": ([1], "not a JSON object of model settings"),
        "eps": ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a positive number, got -1e-05"),
        "kv_heads": ({"num_key_value_heads": 0},
                     "num_key_value_heads must be a positive whole number, got 0"),
        # refused by the model config's checks: named by config.json's key, not only by
        # the model.* key it became (which the user never wrote); a string a ValueError
        "theta_neg": ({rope: {"rope_type": "default", "rope_theta": -1}},
                      f"config.json: {rope}.rope_theta -1 gives model.rotary_base -1: must be "
                      "positive, got -1"),
        "theta_str": ({rope: {"rope_type": "default", "rope_theta": "x"}},
                      f"config.json: {rope}.rope_theta must be a finite number, got 'x'"),
        "groups": ({"num_key_value_heads": 3},
                   f"config.json: num_attention_heads {heads} gives model.num_attention_heads "
                   f"{heads}, num_key_value_heads 3 gives model.num_query_groups 3: "
                   f"model.num_attention_heads ({heads}) must be divisible by "
                   "model.num_query_groups (3)"),
    }
    for name, (change, message) in cases.items():
        folder = tmp_path / name
        shutil.copytree(out, folder)
        (folder / "config.json").write_text(json.dumps(
            {**config, **change} if isinstance(change, dict) else change))
        with pytest.raises(ConfigError) as e:
            import_hf(folder, tmp_path / f"{name}-ckpt")
        assert str(e.value).endswith(message) and "\n" not in str(e.value), (name, e.value)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(out, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match=f"^{no_weights} has no \\*.safetensors weights$"):
        import_hf(no_weights, tmp_path / "nw-ckpt")
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    (weights,) = damaged.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"^{weights}: cannot read it \\("):
        import_hf(damaged, tmp_path / "dm-ckpt")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith("-ckpt")]


def test_force_replaces_an_earlier_export_whole(kv_checkpoint, tmp_path):
    """``--force`` over an earlier export: the new export takes its place whole (what
    was there is gone, nothing half-written or set aside is left beside it); a file
    where the folder should be is refused in one line."""
    path, expected = kv_checkpoint
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a Hugging Face model folder, of before
    (out / "stale.txt").write_text("from before")
    export_hf(path, out, force=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]
    torch.testing.assert_close(hf_logits(load_hf(out), tokens()), expected, atol=1e-4, rtol=1e-4)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=f"^{blocker} exists and is not a folder$"):
        export_hf(path, blocker, force=True)


def test_force_replaces_no_run_checkpoint_or_current_folder(kv_checkpoint, tmp_path,
                                                             monkeypatch):
    """``--force`` removed whatever OUT_DIR held: ``export hf RUN RUN --force`` deleted
    the run (exit 0), an OUT_DIR above the run deleted every run beside it, and an
    unset ``"$OUT"`` (the current folder) everything there. Now each is one line
    before the checkpoint is loaded, and every file is kept."""
    from kvtrain.inference import loading

    path, _ = kv_checkpoint  # tmp_path/ckpt/iter_0000001, say
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded"))
    (tmp_path / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    cases = {path: f"--force would replace {path}, which holds the checkpoint being exported",
             path.parent: f"--force would replace {path.parent}, which holds the checkpoint",
             tmp_path: f"--force would replace {tmp_path}, which holds the checkpoint"}
    for out, line in cases.items():
        with pytest.raises(ConfigError, match=f"^{re.escape(line)}"):
            export_hf(path, out, force=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.txt").write_text("x")
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError, match=f"^--force would replace {elsewhere}, which holds the "
                                          "current folder: export to another folder$"):
        export_hf(path, "", force=True)
    monkeypatch.chdir(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=f"^--force replaces a Hugging Face model folder \\(an "
                                          f"earlier export\\); {elsewhere} holds no config.json"):
        export_hf(path, elsewhere, force=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == \
        sorted(before + [Path("elsewhere"), Path("elsewhere/data.txt")])


def test_an_export_that_cannot_be_written_is_one_line_before_loading(kv_checkpoint, tmp_path,
                                                                      monkeypatch):
    """A file in the output's path, or a file system that takes no folder (/proc):
    it was a FileExistsError / FileNotFoundError traceback after the checkpoint was
    loaded; now one line before it is (the loader must not be reached)."""
    from kvtrain.inference import loading

    path, _ = kv_checkpoint
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded"))
    (tmp_path / "file").write_text("x")
    for out, why in ((tmp_path / "file" / "o3", f"{tmp_path / 'file'} is a file, not a folder"),
                     (Path("/proc/kvtrain-export"), "")):
        with pytest.raises(ConfigError, match=f"^cannot export to {out}: {why}"):
            export_hf(path, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "file"]


def test_a_distinct_lm_head_in_a_tied_folder_is_named_as_it_is_dropped(mp1, tmp_path, capsys):
    """config.json ties the embeddings but the weights hold an lm_head that differs:
    the import ties them as transformers loads the folder, and says in one line that
    the file's lm_head goes unused (it went without a word)."""
    from kvtrain.hf.export import export_model

    cfg = run_config(model_config(untie_embeddings=True))
    (tmp_path / "hf").mkdir()
    export_model(build(cfg), cfg, tmp_path / "hf")
    config = tmp_path / "hf" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tie_word_embeddings": True}))
    back = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"kvtrain: warning: {config} ties the embeddings (tie_word_embeddings: "
                   "true) but its weights hold an lm_head.weight that differs from "
                   "model.embed_tokens.weight: it is left out and the output layer is the "
                   "embedding, as transformers loads the folder"]
    assert not saved_config(back)[0].model.untie_embeddings


def test_the_end_of_document_id_of_a_folder_is_imported(mp1, tmp_path):
    """A run whose end-of-document id is not the vocabulary's last (``data.eod_id``, or
    a tokenizer's EOS) exports it as ``eos_token_id``; the import kept it only where
    the run separated documents, so ``kvtrain generate`` on the imported checkpoint fed
    and stopped at the last id (the default) instead: other tokens, without a word.
    A ``--config`` decides (the run's YAML: the resume compares equal), and so does a
    tokenizer or EOD ``--set`` names; an EOS that is the default or no token of the
    vocabulary is not written."""
    from kvtrain.hf.importer import import_config
    from kvtrain.inference.generate import PromptCodec, SamplingOptions, generate

    cfg = run_config(model_config())
    cfg.data.eod_id = 7
    path = save_weights(build(cfg), cfg, tmp_path / "ckpt" / "iter_0000000")
    back = import_hf(export_hf(path, tmp_path / "hf"), tmp_path / "imported")
    assert saved_config(back)[0].data.eod_id == 7
    runs = []
    for source in (path, back):
        loaded = load_model(source, backend="local")
        (g,) = generate(loaded.model, loaded.config, PromptCodec.for_run(loaded.config),
                        [("3 4 5", {})], SamplingOptions(max_new_tokens=6))
        runs.append((g.prompt_tokens, g.tokens))
    assert runs[1] == runs[0] and runs[0][0][0] == 7
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for change, overrides, eod in (({}, ["data.eod_id=9"], 9),
                                   ({}, ["data.tokenizer=t.model"], None),
                                   ({"eos_token_id": VOCAB - 1}, [], None),
                                   ({"eos_token_id": VOCAB}, [], None),
                                   ({"eos_token_id": [2, 3]}, [], None),
                                   ({"eos_token_id": None}, [], None)):
        got = import_config({**config, **change}, "config.json", overrides=overrides)
        assert got.data.eod_id == eod, (change, overrides)
    (tmp_path / "run.yaml").write_text("train: {seed: 3}\n")
    assert import_config(config, "config.json", tmp_path / "run.yaml").data.eod_id is None


def test_a_config_whose_model_is_not_the_folders_is_one_line(tmp_path):
    """``--config`` is the training config the imported run will use: a model key it
    sets that the folder's weights decide otherwise was replaced by the folder's, unsaid,
    and the YAML could not resume the checkpoint (a probe's). Refused, naming both; the
    keys it leaves out come from the folder, and one that agrees passes."""
    from kvtrain.hf.importer import import_config

    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "vocab_size": VOCAB, "max_position_embeddings": 64, "rope_theta": 10000.0}
    run = tmp_path / "run.yaml"
    run.write_text("model: {num_layers: 4, hidden_size: 32}\n")
    with pytest.raises(ConfigError) as e:
        import_config(base, "hf/config.json", run)
    assert str(e.value) == (f"{run}: model.num_layers (4) differs from hf/config.json (2): the "
                            "weights decide the architecture (leave it out of the config, or "
                            "give the folder's)")
    run.write_text("model: {num_layers: 2, hidden_size: 32}\ntrain: {seed: 3}\n")
    cfg = import_config(base, "hf/config.json", run)
    assert (cfg.model.num_layers, cfg.model.rotary_base, cfg.train.seed) == (2, 10000, 3)


def test_a_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(tmp_path):
    """A ``rope_scaling`` added to a transformers-5 config.json (which writes
    ``rope_parameters``: the context-extension recipes add ``rope_scaling``) is what
    transformers loads the folder with; the import read ``rope_parameters`` first and
    imported a linearly scaled Llama as plain RoPE, other logits without a word."""
    from transformers import LlamaConfig

    from kvtrain.hf.importer import import_config

    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "vocab_size": VOCAB, "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    scaled = {**base, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert LlamaConfig(**json.loads(json.dumps(scaled))).rope_parameters["rope_type"] == "linear"
    with pytest.raises(ConfigError, match="^config.json: RoPE scaling 'linear' is not supported"):
        import_config(scaled, "config.json")
    other_base = {**base, "rope_scaling": {"rope_type": "default", "rope_theta": 5000.0}}
    read = LlamaConfig(**json.loads(json.dumps(other_base))).rope_parameters["rope_theta"]
    assert import_config(other_base, "config.json").model.rotary_base == read == 5000
    assert import_config(base, "config.json").model.rotary_base == 100000


def test_the_tokenizer_of_a_folder_is_carried_into_the_import(mp1, tmp_path, capsys):
    """An export holds the run's sentencepiece model as ``tokenizer.model``; the import
    left it behind (``data.tokenizer`` null), so ``kvtrain generate`` on the imported
    checkpoint took text prompts only with ``--tokenizer``. Now the checkpoint holds
    a copy (in its manifest) and its ``data.tokenizer`` names it: the same text, the
    same tokens, with the export folder and the run's own model gone. A ``--config``
    or ``--set`` naming a tokenizer or an EOD decides instead; a ``tokenizer.model``
    kvtrain cannot read is left behind with one warning."""
    import shutil

    from kvtrain.inference.generate import PromptCodec, SamplingOptions, generate
    from kvtrain.train.integrity import MARKER
    from tests.hf.test_layouts import sentencepiece_model

    cfg = run_config(model_config(vocab_size=384))
    (tmp_path / "sp").mkdir()
    cfg.data.eod_id, cfg.data.tokenizer = None, sentencepiece_model(tmp_path / "sp")
    path = save_weights(build(cfg), cfg, tmp_path / "ckpt" / "iter_0000000")
    runs = []
    loaded = load_model(path, backend="local")
    (g,) = generate(loaded.model, loaded.config, PromptCodec.for_run(loaded.config),
                    [("the model", {})], SamplingOptions(max_new_tokens=6))
    runs.append((g.prompt_tokens, g.tokens, g.text))
    hf = export_hf(path, tmp_path / "hf")
    kept = shutil.copytree(hf, tmp_path / "kept")  # for what decides instead, below
    shutil.rmtree(tmp_path / "sp")
    back = import_hf(hf, tmp_path / "imported")
    shutil.rmtree(hf)
    carried = saved_config(back)[0].data.tokenizer
    assert carried == str(back / "tokenizer.model"), carried
    manifest = json.loads((back / MARKER).read_text())["manifest"]["files"]
    assert "tokenizer.model" in manifest
    loaded = load_model(back, backend="local")
    (g,) = generate(loaded.model, loaded.config, PromptCodec.for_run(loaded.config),
                    [("the model", {})], SamplingOptions(max_new_tokens=6))
    runs.append((g.prompt_tokens, g.tokens, g.text))
    assert runs[1] == runs[0]

    hf = kept
    (tmp_path / "run.yaml").write_text("train: {seed: 3}\n")
    for options, expected in (({"config": tmp_path / "run.yaml"}, None),
                              ({"overrides": ["data.tokenizer=t.model"]}, "t.model"),
                              ({"overrides": ["data.eod_id=5"]}, None)):
        out = tmp_path / f"decided{len(list(tmp_path.glob('decided*')))}"
        assert saved_config(import_hf(hf, out, **options))[0].data.tokenizer == expected
        assert not (out / "tokenizer.model").exists(), options
    from kvtrain.cli import main

    capsys.readouterr()
    assert main(["import", "hf", str(hf), str(tmp_path / "cli")]) == 0
    assert f"as {tmp_path / 'cli'} with the folder's tokenizer.model (" in capsys.readouterr().out
    (hf / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    back = import_hf(hf, tmp_path / "unreadable")
    assert saved_config(back)[0].data.tokenizer is None
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 1 and warned[0].startswith(
        f"kvtrain: warning: {hf / 'tokenizer.model'} is left out of the import ("), warned
    assert warned[0].endswith("kvtrain generate on it takes --tokenizer"), warned
