"""Strict typed config loading: unknown keys, wrong types, lines, overrides."""

from __future__ import annotations

import pytest

from kvtrain.config import ConfigError, RunConfig, load_config, to_dict
from kvtrain.config.loader import dump_yaml


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_validate():
    cfg = load_config(None)
    assert isinstance(cfg, RunConfig) and cfg.model.attention == "vanilla"


def test_one_key_picks_kv_shift_and_variants(tmp_path):
    path = write(tmp_path, """
model:
  attention: kv_shift
  kv_shift: {shift: [q, k, v], window: 2, mode: gate}
""")
    cfg = load_config(path)
    assert cfg.model.attention == "kv_shift"
    assert cfg.model.kv_shift.shift == ["q", "k", "v"]
    assert (cfg.model.kv_shift.window, cfg.model.kv_shift.mode) == (2, "gate")


def test_unknown_key_names_path_line_and_suggestion(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 2\n  hiden_size: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert f"{path}:3" in msg and "'model.hiden_size'" in msg
    assert "did you mean 'model.hidden_size'" in msg


def test_wrong_type_names_key_and_type(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: ten\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: train.max_steps: expected int \| null"):
        load_config(path)
    path = write(tmp_path, "model:\n  attention: kvshift\n")
    with pytest.raises(ConfigError, match=r"model.attention: expected one of 'vanilla', 'kv_shift'"):
        load_config(path)
    path = write(tmp_path, "model:\n  kv_shift:\n    shift: [k, x]\n")
    with pytest.raises(ConfigError, match=r"model.kv_shift.shift\[1\]"):
        load_config(path)


def test_section_must_be_mapping_and_no_duplicates(tmp_path):
    with pytest.raises(ConfigError, match="model: expected a mapping"):
        load_config(write(tmp_path, "model: 3\n"))
    with pytest.raises(ConfigError, match=r"c.yaml:3: duplicate key 'lr'"):
        load_config(write(tmp_path, "optimizer:\n  lr: 1.0\n  lr: 2.0\n"))


def test_invalid_yaml_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"c.yaml:3: invalid YAML"):
        load_config(write(tmp_path, "model:\n  - a\n  b: c\n"))


def test_numbers(tmp_path):
    cfg = load_config(write(tmp_path, "optimizer:\n  lr: 1e-4\ntrain:\n  train_tokens: 1.0e9\n"))
    assert cfg.optimizer.lr == 1e-4 and cfg.train.train_tokens == 10**9
    with pytest.raises(ConfigError, match="expected bool"):
        load_config(write(tmp_path, "parallel:\n  sequence_parallel: 1\n"))


def test_overrides_use_the_same_checks(tmp_path):
    cfg = load_config(None, ["model.attention=kv_shift", "parallel.tensor=1",
                             "model.kv_shift.window=3"])
    assert cfg.model.attention == "kv_shift" and cfg.model.kv_shift.window == 3
    with pytest.raises(ConfigError, match="--set: unknown key 'model.atention'.*'model.attention'"):
        load_config(None, ["model.atention=kv_shift"])
    with pytest.raises(ConfigError, match="model.kv_shift.window: expected int"):
        load_config(None, ["model.kv_shift.window=big"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["model.attention"])


@pytest.mark.parametrize("overrides,message", [
    (["model.hidden_size=100", "model.num_attention_heads=3"], "divisible by model.num_attention_heads"),
    (["model.num_query_groups=3"], "model.num_attention_heads (4) must be divisible by model.num_query_groups (3)"),
    (["parallel.tensor=4", "model.num_query_groups=2"], "model.num_query_groups (2) must be divisible by parallel.tensor (4)"),
    (["model.kv_shift.window=4"], "model.kv_shift.window must be 1, 2 or 3"),
    (["model.kv_shift.shift=[]"], "must name at least one"),
    (["train.seq_length=4096"], "exceeds model.max_position_embeddings"),
    (["parallel.pipeline=3"], "model.num_layers (2) must be divisible by parallel.pipeline"),
    (["data.type=induction", "data.induction.max_val=99999"],
     "data.induction.max_val (99999) exceeds model.vocab_size (32000)"),
    (["data.type=induction", "data.reset_attention_mask=true"], "has one sequence per sample"),
    (["data.type=ngram", "data.eval_seed=7", "train.seed=7"],
     "data.eval_seed (7) must differ from the training data seed (7)"),
    (["data.type=induction", "data.induction.mid_val=7990"], "data.induction: need 2 <= pool_size"),
])
def test_cross_field_checks(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_round_trip(tmp_path):
    cfg = load_config(None, ["model.attention=kv_shift", "model.kv_shift.mode=clamp"])
    again = load_config(write(tmp_path, dump_yaml(cfg)))
    assert to_dict(again) == to_dict(cfg)


def test_a_config_that_is_not_text_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"model:\n  num_layers: 2 \xff\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}:2: not UTF-8 text (byte 0xff)"


def test_bad_override_values_are_one_line_naming_the_override(tmp_path):
    """A --set value is blamed on the --set, not on the file line it replaces."""
    path = write(tmp_path, "optimizer:\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["optimizer.lr=abc"])
    assert str(e.value) == "--set: optimizer.lr: expected float, got 'abc'"
    with pytest.raises(ConfigError) as e:
        load_config(path, ["model.num_layers=[1"])
    assert str(e.value).startswith("--set model.num_layers: cannot parse value '[1': ")
    assert "\n" not in str(e.value)
