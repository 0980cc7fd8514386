"""Export parity from checkpoints of other layouts, and the trainer around the
export and the import:

* a KV-shift model saved at TP=2 and at PP=2 (one ``run_distributed`` launch:
  the logits computed at the saving layout) exports to a HF model with the same
  logits (through ``load_model``'s resharding into one process);
* one ``run_driver`` launch of two TP=2 trainings: a run on the text corpus
  (exported from its run folder, tokenizer included) and a run that starts from
  an imported checkpoint (saved at TP=1) and trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kvtrain.hf.export import export_hf, export_model
from kvtrain.hf.importer import import_hf, save_weights
from tests.train.conftest import metrics, run_driver, tiny_config, write_config

from .helpers import VOCAB, hf_logits, load_hf, model_config, run_config, tokens

pytestmark = pytest.mark.slow


def _build(cfg, tensor: int, pipeline: int):
    """This rank's model at TP x PP, shift coefficients drawn per global head."""
    from kvtrain.backend import init_model_parallel, set_seed
    from kvtrain.config import ParallelConfig
    from kvtrain.model.builder import build_gpt, transformer_config

    init_model_parallel(tensor, pipeline)
    set_seed(1234)  # megatron's RNG tracker (the weights come from their own streams)
    tconfig = transformer_config(cfg.model, ParallelConfig(tensor=tensor, pipeline=pipeline))
    model = build_gpt(cfg.model, tconfig, seed=cfg.train.seed, backend="local").eval()
    rank = dist.get_rank() if tensor > 1 else 0  # TP ranks hold different heads
    gen = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "shift" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.8 + 0.3)
    return model


def _logits(model, pipeline: int):
    """Full-vocabulary logits ``[b, s, vocab]`` on the last stage (None elsewhere)."""
    tok = tokens()
    pos = torch.arange(tok.shape[1])[None].expand_as(tok)
    with torch.no_grad():
        if pipeline > 1 and dist.get_rank() == 0:  # first stage: hand the hidden states on
            dist.send(model(tok, pos, None).contiguous(), dst=1)
            return None
        if pipeline > 1:
            hidden = torch.empty(tok.shape[1], tok.shape[0], model.config.hidden_size)
            dist.recv(hidden, src=0)
            model.set_input_tensor(hidden)
        return model(tok, pos, None, runtime_gather_output=True)[..., :VOCAB].float()


def save_layouts(rank: int, world: int, root: str) -> dict:
    """Saves the model at TP=2, then at PP=2; returns each layout's logits."""
    cfg = run_config(model_config(num_layers=2))
    out = {}
    for name, (tp, pp) in {"tp2": (2, 1), "pp2": (1, 2)}.items():
        model = _build(cfg, tp, pp)
        save_weights(model, cfg, Path(root) / name / "iter_0000000")
        out[name] = _logits(model, pp)
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    from kvtrain.testing import run_distributed

    root = tmp_path_factory.mktemp("layouts")
    results = run_distributed(save_layouts, 2, str(root))
    return root, {"tp2": results[0]["tp2"], "pp2": results[1]["pp2"]}


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_export_parity_from_other_layouts(mp1, layouts, tmp_path, layout):
    root, logits = layouts
    out = export_hf(root / layout, tmp_path / "hf")
    torch.testing.assert_close(hf_logits(load_hf(out), tokens()), logits[layout],
                               atol=1e-4, rtol=1e-4)


def sentencepiece_model(folder: Path) -> str:
    """A BPE tokenizer of 384 pieces with kvtrain's training options, on the repo's docs."""
    import sentencepiece as spm

    from data_tools.train_tokenizer import trainer_options

    repo = Path(__file__).resolve().parents[2]
    lines = [line for doc in sorted(repo.glob("docs/*.md")) + [repo / "README.md"]
             for line in doc.read_text().splitlines() if line.strip()]
    options = dict(trainer_options(384, threads=1), minloglevel=2)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines),
                                   model_prefix=str(folder / "tok"), **options)
    return str(folder / "tok.model")


def test_trainer_run_exports_and_imported_checkpoint_trains(mp1, tmp_path):
    """A TP=2 run folder exports with its tokenizer; a TP=2 run starts from an
    imported (TP=1) checkpoint at iteration 0 and trains."""
    from transformers import AutoTokenizer

    model_file = sentencepiece_model(tmp_path)
    base = tiny_config(None, tmp_path / "cache", parallel={"tensor": 2},
                       train={"max_steps": 2, "global_batch_size": 4},
                       checkpoint={"save_interval": 2})
    base["data"]["tokenizer"] = model_file  # mock tokens; the export takes the tokenizer
    trained_cfg = write_config(tmp_path / "a.yaml", base)
    # the imported model: a vanilla Llama getting KV shift, the run's YAML as its config
    tiny = run_config(model_config(attention="vanilla", vocab_size=base["model"]["vocab_size"],
                                   rotary_base=100000))
    (tmp_path / "llama").mkdir()
    export_model(_build(tiny, 1, 1), tiny, tmp_path / "llama")
    resumed = dict(base, checkpoint={"resume": str(tmp_path / "imported"), "load_optimizer": False,
                                     "save_interval": 2})
    resumed_cfg = write_config(tmp_path / "b.yaml", resumed)
    import_hf(tmp_path / "llama", tmp_path / "imported", config=resumed_cfg)
    jobs = [{"config": str(trained_cfg), "run_dir": str(tmp_path / "a")},
            {"config": str(resumed_cfg), "run_dir": str(tmp_path / "b")}]
    result = run_driver(jobs, tmp_path / "plan.json", nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from {tmp_path / 'imported'} at iteration 0" in result.stdout
    steps = [r["iteration"] for r in metrics(tmp_path / "b")]
    assert steps == [1, 2] and all(r["lm_loss"] < 10 for r in metrics(tmp_path / "b"))
    out = export_hf(tmp_path / "a", tmp_path / "hf")
    record = json.loads((out / "kvtrain_export.json").read_text())
    assert record["iteration"] == 2 and record["run_dir"] == str(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(str(out))
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_file)
    text = "Return the value of x, 42 times.\n  Indented"
    assert tok(text)["input_ids"] == sp.encode(text)
    assert (tok.eos_token_id, tok.pad_token_id) == (sp.eos_id(), sp.pad_id())
