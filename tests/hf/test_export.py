"""Export parity: the Hugging Face model's logits equal kvtrain's (fp32, 1e-4),
for vanilla (stock LlamaForCausalLM, no custom code) and every KV-shift variant
(remote code): K/V/QKV, windows 1-3, free/gate/clamp, GQA and MHA, tied
embeddings."""

from __future__ import annotations

import json

import pytest
import torch

from kvtrain.hf.export import export_model

from .helpers import build, hf_logits, kvtrain_logits, load_hf, model_config, run_config, tokens

VARIANTS = {
    "vanilla-gqa": dict(attention="vanilla"),
    "vanilla-tied-mha": dict(attention="vanilla", untie_embeddings=False, num_query_groups=None),
    "kv-w1-free-gqa": dict(kv_shift={"shift": ["k", "v"], "window": 1, "mode": "free"}),
    "k-w2-gate": dict(kv_shift={"shift": ["k"], "window": 2, "mode": "gate"}),
    "v-w3-clamp": dict(kv_shift={"shift": ["v"], "window": 3, "mode": "clamp"}),
    "qkv-w1-clamp-mha": dict(num_query_groups=None,
                             kv_shift={"shift": ["q", "k", "v"], "window": 1, "mode": "clamp"}),
    "qkv-w3-gate-gqa1-tied": dict(num_query_groups=1, untie_embeddings=False,
                                  kv_shift={"shift": ["q", "k", "v"], "window": 3,
                                            "mode": "gate"}),
}


def _model_config(over: dict):
    from kvtrain.config import KVShiftConfig

    over = dict(over)
    if "kv_shift" in over:
        over["kv_shift"] = KVShiftConfig(**over["kv_shift"])
    return model_config(**over)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_export_parity(mp1, tmp_path, variant):
    cfg = run_config(_model_config(VARIANTS[variant]))
    model = build(cfg)
    export_model(model, cfg, tmp_path, record={"iteration": 0})
    hf = load_hf(tmp_path)
    tok = tokens()
    torch.testing.assert_close(hf_logits(hf, tok), kvtrain_logits(model, tok), atol=1e-4, rtol=1e-4)
    config = json.loads((tmp_path / "config.json").read_text())
    if cfg.model.attention == "vanilla":  # stock Llama: no custom code anywhere
        assert type(hf).__name__ == "LlamaForCausalLM"
        assert "auto_map" not in config and not list(tmp_path.glob("*.py"))
    else:
        assert type(hf).__name__ == "KVShiftLlamaForCausalLM"
        assert config["kv_shift"]["window"] == cfg.model.kv_shift.window


def test_exported_tokenizer_reads_special_piece_text_as_sentencepiece_does(tmp_path):
    """A text holding "</s>", "<s>", "<pad>" or "<unk>" is plain text to sentencepiece
    (what preprocessing and ``kvtrain generate`` encode with): the exported tokenizer
    must not turn it into the special ids (an EOD inside a document lm-eval scores)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from kvtrain.hf.tokenizer import export_tokenizer
    from tests.hf.test_layouts import sentencepiece_model

    model_file = sentencepiece_model(tmp_path)
    (tmp_path / "hf").mkdir()
    export_tokenizer(model_file, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sp = spm.SentencePieceProcessor(model_file=model_file)
    for text in ("a</s>b", "x <s> y", "<pad> and <unk>"):
        assert tok(text)["input_ids"] == sp.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
    assert (tok.eos_token_id, tok.pad_token_id) == (sp.eos_id(), sp.pad_id())


def test_a_run_without_tokenizer_exports_the_eod_kvtrain_generate_stops_at(mp1, tmp_path):
    """data.tokenizer and data.eod_id null (mock data, foreign shards): kvtrain's
    loaders take the last id of the vocabulary as the end of a document, and so does
    the export (config.json and generation_config.json), so HF generate stops there."""
    from kvtrain.data.tokenizer import load_tokenizer

    cfg = run_config(model_config(attention="vanilla"))
    cfg.data.eod_id = None
    export_model(build(cfg), cfg, tmp_path, record={"iteration": 0})
    eod = load_tokenizer(cfg.data, cfg.model).eod
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == eod
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == eod
