"""The Appendix J pair (configs/paper/mla_*.yaml) trains through the trainer.

Both files, shrunk to a tiny shape (the MLA ranks and head dims scaled down, the
attention variant, the App. J head selection and the optimizer kept), train a
few steps on the test corpus in one driver launch, evaluate, log the shift
coefficients and save a checkpoint.
"""

from __future__ import annotations

import json
import math

from kvtrain.config import read_yaml

from .conftest import REPO, VOCAB, by_iteration, metrics, run_driver, tiny_config, write_config

TINY_MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": None,
              "ffn_hidden_size": 64, "vocab_size": VOCAB, "make_vocab_size_divisible_by": 64,
              "max_position_embeddings": 64}
TINY_MLA = {"kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8}


def shrunk(name: str, corpus, cache_dir) -> dict:
    # plain dicts (read_yaml's keep their lines) for the YAML writer
    paper = json.loads(json.dumps(read_yaml(REPO / "configs" / "paper" / f"mla_{name}.yaml")))
    model = {**paper["model"], **TINY_MODEL, "mla": {**paper["model"]["mla"], **TINY_MLA}}
    optimizer = {**paper["optimizer"], "lr_warmup_steps": 2}
    return tiny_config(corpus, cache_dir, name=paper["name"], model=model, optimizer=optimizer,
                       train={"max_steps": 4, "eval_interval": 4, "eval_iters": 1,
                              "kv_shift_stats_interval": 2},
                       checkpoint={"save_interval": 4})


def test_appendix_j_configs_train(tmp_path, corpus, cache_dir):
    jobs = []
    for name in ("vanilla", "kv_shift"):
        config = write_config(tmp_path / f"{name}.yaml", shrunk(name, corpus, cache_dir))
        jobs.append({"config": str(config), "run_dir": str(tmp_path / name)})
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    first = {}
    for name in ("vanilla", "kv_shift"):
        run_dir = tmp_path / name
        train = by_iteration(metrics(run_dir))
        assert sorted(train) == [1, 2, 3, 4]
        assert all(math.isfinite(r["lm_loss"]) for r in train.values())
        first[name] = train[1]["lm_loss"]
        (val,) = metrics(run_dir, "valid")
        assert math.isfinite(val["val_loss"])
        assert (run_dir / "checkpoints" / "latest").read_text().strip()
        saved = read_yaml(run_dir / "config.yaml")["model"]
        assert saved["mla"]["kv_lora_rank"] == 16 and saved["attention"] == name
    assert first["vanilla"] != first["kv_shift"]  # the shift changes the model
    # App. J's fixed shift: per layer, 1 of 4 heads takes the previous key (value): 3/4 own
    stats = metrics(tmp_path / "kv_shift", "kv_shift")
    assert [r["iteration"] for r in stats] == [2, 4]
    assert stats[-1]["kv_shift/layer_01/alpha1"] == stats[-1]["kv_shift/layer_02/beta1"] == 0.75
