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


def test_yaml_merge_keys_are_read_as_yaml_reads_them(tmp_path):
    """``<<: *base`` is YAML (PyYAML's safe_load reads it): it was refused as
    "could not determine a constructor for the tag 'tag:yaml.org,2002:merge'". The
    base's entries come first; the mapping's own replace them; a key twice among its
    own is still a duplicate; a base that is no mapping is one line."""
    from kvtrain.config.loader import read_yaml

    text = ("model: &m\n  hidden_size: 64\n  num_layers: 2\n"
            "wandb:\n  project: p\n"
            "other: {<<: *m, num_layers: 3}\n")
    data = read_yaml(write(tmp_path, text))
    assert data["other"] == {"hidden_size": 64, "num_layers": 3}
    assert data["other"].lines == {"hidden_size": 2, "num_layers": 6}
    with pytest.raises(ConfigError, match=r"c.yaml:5: duplicate key 'num_layers'"):
        read_yaml(write(tmp_path, "a: &m {x: 1}\nb:\n  <<: *m\n  num_layers: 1\n"
                                  "  num_layers: 2\n"))
    with pytest.raises(ConfigError) as e:
        read_yaml(write(tmp_path, "a: &s 3\nb:\n  <<: *s\n"))
    assert str(e.value).startswith(f"{tmp_path / 'c.yaml'}:3: invalid YAML: expected a mapping")


def test_a_key_that_is_a_list_or_mapping_is_one_line(tmp_path):
    """YAML allows a complex key (`? [a, b]`); no config key is one, and it was
    a TypeError traceback (unhashable type: 'list') from the loader."""
    path = write(tmp_path, "model:\n  ? [a, b]\n  : 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}:2: a key must be a name, got a list"
    with pytest.raises(ConfigError, match="c.yaml:1: a key must be a name, got a mapping"):
        load_config(write(tmp_path, "{a: 1}: 2\n"))


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
    # -1 passed the layer check (layers % -2 == 0) and kvtrain plan
    (["parallel.pipeline=2", "parallel.virtual_pipeline=-1"],
     "parallel.virtual_pipeline must be >= 1 (or null), got -1"),
    (["data.type=ngram", "data.eval_seed=7", "train.seed=7"],
     "data.eval_seed (7) must differ from the training data seed (7)"),
    (["data.type=induction", "data.induction.mid_val=7990"], "data.induction: need 2 <= pool_size"),
    # numpy's words, naming the section only: 'high <= 0', 'negative dimensions ...'
    (["data.type=ngram", "data.ngram.num_pairs=0"], "data.ngram.num_pairs must be >= 1, got 0"),
    (["data.type=ngram", "data.ngram.table_seed=-1"],
     "data.ngram.table_seed must be >= 0, got -1"),
    (["data.type=induction", "data.induction.length=0"],
     "data.induction.length must be >= 1, got 0"),
    (["data.type=ngram", "data.ngram.table_seed=4294967296"],
     "data.ngram.table_seed must be below 2**32, got 4294967296"),
    (["data.type=induction", "data.induction.pool_size=0"],
     "data.induction.pool_size must be >= 1, got 0"),
    # megatron applied a constant loss scale at bf16 (and at fp32 under the distributed
    # optimizer) and dropped it silently at fp32 without: fp16's key, refused elsewhere
    (["optimizer.loss_scale=1024"], "optimizer.loss_scale (1024.0) scales fp16's loss: "
                                    "train.precision is auto"),
    (["optimizer.loss_scale=1024", "train.precision=bf16"], "train.precision is bf16"),
    # as Megatron-LM refuses it: a deferred gather after a synchronous reduce, never run
    (["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true"],
     "parallel.overlap_param_gather needs parallel.overlap_grad_reduce"),
])
def test_cross_field_checks(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["train.seed", "data.seed", "data.eval_seed"])
@pytest.mark.parametrize("value", ["-1", str(2**32)])
def test_a_seed_numpy_cannot_take_is_one_line(key, value):
    """megatron's datasets seed numpy.random.RandomState (0 to 2**32 - 1) and the toy
    tasks numpy's SeedSequence (>= 0): a seed outside was a traceback from every rank
    after the process group started, not a config error."""
    data_type = "ngram" if key == "data.eval_seed" else "mock"
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.type={data_type}", f"{key}={value}"])
    assert str(e.value) == f"{key} must be in [0, 2**32 - 1], got {value}"
    assert load_config(None, [f"{key}={2**32 - 1}"])  # the largest one numpy takes


@pytest.mark.parametrize("value,shown", [(str(2**63), str(2**63)), ("1e23", "'1e23'"),
                                         (str(-2**63 - 1), str(-2**63 - 1))])
def test_an_int_beyond_64_bits_is_one_line(tmp_path, value, shown):
    """An int setting beyond 64 bits was accepted: train.max_steps=1e23 hung the
    trainer building its sample index, data.num_workers=10**23 started DataLoader
    workers until the machine ran out of processes."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.num_workers={value}"])
    assert str(e.value) == f"--set: data.num_workers: expected a 64-bit int, got {shown}"
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f"train:\n  max_steps: {value}\n"))
    assert str(e.value).startswith(f"{tmp_path / 'c.yaml'}:2: train.max_steps: expected ")
    assert load_config(None, [f"train.train_tokens={2**63 - 1}"]).train.train_tokens == 2**63 - 1


@pytest.mark.parametrize("minutes", ["1e20", "1.4e12", "153722868"])
def test_a_timeout_torch_cannot_hold_is_one_line(minutes):
    """torch keeps a process group's timeout in 64-bit nanoseconds: a larger
    train.dist_timeout_minutes was a traceback at the start of every rank
    (OverflowError, or a socket 'timed out after -8233720368547758ms')."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"train.dist_timeout_minutes={minutes}"])
    assert str(e.value) == (f"train.dist_timeout_minutes must be at most 153722867 (torch "
                            f"keeps it in 64-bit nanoseconds, 292 years), got {float(minutes)}")
    assert load_config(None, ["train.dist_timeout_minutes=153722867"])


@pytest.mark.parametrize("name", ["''", "' '"])
def test_an_empty_run_name_is_one_line(name):
    """name: '' made the run folder runs/<name> = runs itself: the run's lock,
    checkpoints and metrics went in among the other runs' folders."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"name={name}"])
    assert str(e.value) == ("name is empty: it names the run (its folder runs/<name> and "
                            "its wandb run)")


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


@pytest.mark.parametrize("overrides,message", [
    (["model.num_query_groups=0"], "model.num_query_groups must be positive (or null), got 0"),
    (["model.num_query_groups=-2"], "model.num_query_groups must be positive (or null), got -2"),
    (["model.ffn_hidden_size=-512"], "model.ffn_hidden_size must be positive (or null), got -512"),
    (["model.make_vocab_size_divisible_by=0"],
     "model.make_vocab_size_divisible_by must be positive, got 0"),
    (["model.rotary_base=0"], "model.rotary_base must be positive, got 0"),
    (["model.norm_epsilon=-1e-5"], "model.norm_epsilon must be positive, got -1e-05"),
    (["model.init_method_std=-0.02"], "model.init_method_std must be positive, got -0.02"),
    (["model.attention_dropout=1"], "model.attention_dropout must be in [0, 1), got 1.0"),
    (["model.hidden_dropout=-0.1"], "model.hidden_dropout must be in [0, 1), got -0.1"),
    (["parallel.context=0"], "parallel.tensor, parallel.pipeline and parallel.context must be >= 1"),
    (["parallel.tensor=2", "model.ffn_hidden_size=101"],
     "model.ffn_hidden_size (101) must be divisible by parallel.tensor (2)"),
    (["model.num_layers=4", "parallel.virtual_pipeline=2"],
     "parallel.virtual_pipeline needs parallel.pipeline >= 2"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel needs parallel.tensor >= 2"),
    (["parallel.overlap_param_gather=true", "parallel.distributed_optimizer=false"],
     "parallel.overlap_param_gather needs parallel.distributed_optimizer"),
    (["parallel.tensor=2", "parallel.sequence_parallel=true", "train.seq_length=33",
      "model.max_position_embeddings=64"],
     "train.seq_length (33) must be divisible by parallel.tensor x parallel.context (2)"),
    (["train.micro_batch_size=0"], "train.micro_batch_size and train.global_batch_size must be >= 1"),
    (["train.max_steps=null", "train.train_tokens=null"], "set train.max_steps or train.train_tokens"),
    (["train.log_interval=0"], "train.log_interval must be positive (or null), got 0"),
    (["train.dist_timeout_minutes=-1"], "train.dist_timeout_minutes must be positive (or null)"),
    (["train.eval_interval=5", "train.eval_iters=0"],
     "train.eval_iters must be >= 1 when train.eval_interval is set, got 0"),
    (["train.seq_length=0"], "train.seq_length must be positive, got 0"),
    (["optimizer.lr=0"], "optimizer.lr must be positive, got 0"),
    (["optimizer.min_lr=1"], "optimizer.min_lr (1.0) must be in [0, optimizer.lr"),
    (["optimizer.adam_eps=0"], "optimizer.adam_eps > 0"),
    (["optimizer.clip_grad=-1"], "optimizer.weight_decay and optimizer.clip_grad must be >= 0"),
    (["optimizer.adam_beta2=1"], "optimizer.adam_beta2 must be in [0, 1), got 1"),
    (["optimizer.lr_warmup_steps=-1"], "optimizer.lr_warmup_steps must be >= 0, got -1"),
    (["optimizer.lr_warmup_steps=10", "optimizer.lr_decay_steps=10"],
     "optimizer.lr_decay_steps (10) must exceed optimizer.lr_warmup_steps (10)"),
    (["optimizer.lr_schedule=wsd"], "optimizer.lr_schedule wsd needs optimizer.wsd_decay_steps"),
    # a negative count passed: the decay then never started, the LR stayed at its peak
    (["optimizer.lr_schedule=wsd", "optimizer.wsd_decay_steps=-5"],
     "optimizer.lr_schedule wsd needs optimizer.wsd_decay_steps >= 1, got -5"),
    (["optimizer.lr_schedule=wsd", "optimizer.wsd_decay_steps=1000000"],
     "optimizer.wsd_decay_steps (1000000) must fit after the warmup"),
    # a run sized by train.train_tokens (10 steps of 8 x 32 tokens): the same horizon
    (["optimizer.lr_schedule=wsd", "optimizer.wsd_decay_steps=20", "train.max_steps=null",
      "train.train_tokens=2560", "train.global_batch_size=8", "train.seq_length=32",
      "model.max_position_embeddings=64"],
     "optimizer.wsd_decay_steps (20) must fit after the warmup in the schedule (10 steps"),
    (["optimizer.loss_scale=0"], "optimizer.loss_scale must be positive, got 0"),
    (["data.type=gpt", "data.paths=[]"], "data.paths is empty: name at least one shard prefix"),
    (["data.type=gpt", "data.paths=[0.5, a, b]"],
     "data.paths must be all prefixes or weight, prefix pairs"),
    (["data.type=gpt", "data.paths=[0, a, 1, b]"], "data.paths weights must be positive"),
    # a sum that overflows: a ValueError traceback as the dataset was sized
    (["data.type=gpt", "data.paths=[1e308, a, 1e308, b]"],
     "data.paths weights must sum to a finite number, got [1e+308, 1e+308]: scale them down"),
    (["data.split=a,b"], "data.split must be up to three non-negative training,validation,test"),
    (["data.split=0,1"], "with a positive training part"),
    # numbers float() reads but megatron's split parser (runs of digits and dots) reads
    # otherwise: 1,1e-3 as 1,1,3 (silently), 90,1e1,0 and 1_000,10,0 as four parts (an
    # assertion), 1,inf as 1
    (["data.split=90,1e1,0"], "data.split must be up to three non-negative training,validation"),
    (["data.split=1,1e-3"], "data.split must be up to three non-negative training,validation"),
    (["data.split=1_000,10,0"], "data.split must be up to three non-negative training,valid"),
    (["data.split=1,inf"], "data.split must be up to three non-negative training,validation"),
    (["data.num_workers=-1"], "data.num_workers must be >= 0, got -1"),
    (["data.type=gpt", "data.paths=[a]", "data.reset_attention_mask=true", "data.tokenizer=null",
      "data.eod_id=null"], "need the end-of-document id: set data.tokenizer or data.eod_id"),
    (["data.eod_id=32000"], "data.eod_id (32000) must be a token id below model.vocab_size"),
    (["checkpoint.save_interval=0"], "checkpoint.save_interval must be >= 1 (or null), got 0"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last must be >= 1 (or null), got 0"),
    (["checkpoint.resume=' '"], "checkpoint.resume must be auto, none, or a checkpoint path"),
    (["model.kv_shift.shift=[k, v, k]"], "model.kv_shift.shift has duplicates: ['k', 'v', 'k']"),
    (["model.attention=kv_shift", "model.kv_shift.heads={k: []}"],
     "model.kv_shift.heads.k is empty: drop k from model.kv_shift.shift instead"),
    (["model.attention=kv_shift", "model.kv_shift.heads={v: [1, 1]}"],
     "model.kv_shift.heads.v has duplicates: [1, 1]"),
    (["model.mla={q_lora_rank: 0}", "model.num_query_groups=null"],
     "model.mla.q_lora_rank must be positive or null, got 0"),
    (["model.mla={}", "model.num_query_groups=null", "model.position_embedding=none"],
     "model.mla needs model.position_embedding: rope (MLA's decoupled RoPE key)"),
])
def test_each_value_refusal_is_one_line_naming_its_keys(overrides, message):
    """The single-field checks of ``RunConfig.validate``, each reached from --set."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_file_that_is_not_a_readable_mapping_is_one_line(tmp_path):
    for text, message in (("- a\n- b\n", "the top level must be a mapping, got list"),):
        path = write(tmp_path, text)
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert str(e.value) == f"{path}: {message}"
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)  # a folder
    assert str(e.value) == f"cannot read config {tmp_path}: Is a directory"
    # an empty file (a failed copy, /dev/null) trained the defaults: mock data, exit 0
    for text in ("", "# nothing but a comment\n", "{}\n"):
        empty = write(tmp_path, text)
        with pytest.raises(ConfigError) as e:
            load_config(empty, ["train.max_steps=2"])
        assert str(e.value) == f"{empty} holds no settings (an empty file): a run config names " \
            "at least its model, data and train settings (configs/demo.yaml is one)"


@pytest.mark.parametrize("override,message", [
    ("model.attention.window=2", "--set: 'model.attention' is a 'vanilla' | 'kv_shift', "
                                 "not a section"),
    ("wandb.project=[a]", "--set: wandb.project: expected str, got ['a']"),
    ("model.kv_shift.shift=k", "--set: model.kv_shift.shift: expected list of"),
    ("data.reset_attention_mask=1", "--set: data.reset_attention_mask: expected bool, got 1"),
])
def test_an_override_of_the_wrong_shape_is_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_set_of_a_section_merges_into_the_files_section(tmp_path):
    """`--set 'model.kv_shift.heads={k: [0]}'` changes heads.k only: the file's other
    keys of that section (and of sections nested in the value) stay."""
    path = write(tmp_path, "model:\n  attention: kv_shift\n  kv_shift:\n    window: 1\n"
                           "    heads: {k: [1], v: [1], fixed: true}\n")
    heads = load_config(path, ["model.kv_shift.heads={k: [0]}"]).model.kv_shift.heads
    assert (heads.k, heads.v, heads.fixed) == ([0], [1], True)
    model = load_config(path, ["model={kv_shift: {heads: {v: [2]}}}"]).model
    assert model.attention == "kv_shift"
    assert (model.kv_shift.heads.k, model.kv_shift.heads.v) == ([1], [2])
    with pytest.raises(ConfigError) as e:
        load_config(path, ["model.kv_shift={heads: {kk: [0]}}"])
    assert str(e.value).startswith("--set: unknown key 'model.kv_shift.heads.kk'"), str(e.value)
    assert load_config(path, ["model.kv_shift.heads=null"]).model.kv_shift.heads is None
    # an empty section merges nothing: the file's keys stay (it replaced them by defaults)
    model = load_config(path, ["model={}"]).model
    assert model.attention == "kv_shift" and model.kv_shift.heads.fixed is True
    assert load_config(path, ["model.kv_shift.heads={}"]).model.kv_shift.heads.k == [1]
    # ... and an optional section the file leaves out is switched on with its defaults
    assert load_config(path, ["model.mla={}", "model.num_query_groups=null"]).model.mla \
        is not None


def test_a_zero_padded_int_is_decimal_in_files_and_overrides(tmp_path):
    """YAML 1.1 reads 010 as octal 8 but 08 as the string '08' (then 8): a
    zero-padded number means its decimal value everywhere (hex stays hex)."""
    path = write(tmp_path, "train:\n  seed: 010\n  max_steps: 0_100\n  eval_iters: 09\n"
                           "  log_interval: 0x10\n")
    t = load_config(path).train
    assert (t.seed, t.max_steps, t.eval_iters, t.log_interval) == (10, 100, 9, 16)
    t = load_config(None, ["train.seed=010", "train.train_tokens=08"]).train
    assert t.seed == 10 and t.train_tokens == 8
    with pytest.raises(ConfigError, match="train.max_steps must be positive.*got -7"):
        load_config(None, ["train.max_steps=-07"])


@pytest.mark.parametrize("value", ["nan", ".nan", "inf", "-.inf", "-Infinity"])
@pytest.mark.parametrize("key", ["optimizer.lr", "optimizer.weight_decay", "optimizer.adam_eps",
                                 "train.dist_timeout_minutes", "optimizer.clip_grad"])
def test_a_float_setting_that_is_not_finite_is_one_line(key, value):
    """nan passes every `<= 0` check (and inf means nothing for these settings)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    assert str(e.value).startswith(f"--set: {key}: expected a finite number, got "), str(e.value)


def test_a_non_finite_float_in_a_file_names_the_file_line_and_key(tmp_path):
    path = write(tmp_path, "optimizer:\n  lr: .nan\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}:2: optimizer.lr: expected a finite number, got nan"


def test_shards_named_without_a_data_type_are_read(tmp_path):
    """data.type defaulted to mock: a config naming its shards but not ``type: gpt``
    validated and trained on random tokens, never reading the shards. Left out, the
    type is now gpt where data.paths names shards, mock where it names none; an
    explicit mock (a benchmark of a real config) still draws random tokens."""
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  paths: [shards/a_text_document]\n")
    assert load_config(str(path), []).data.type == "gpt"
    assert load_config(str(path), ["data.type=mock"]).data.type == "mock"
    assert load_config(None, []).data.type == "mock"
    assert load_config(None, ["data.tokenizer=t.model"]).data.type == "mock"
    # the resolved type is what the run records (its config.yaml)
    assert to_dict(load_config(str(path), []))["data"]["type"] == "gpt"


def test_a_config_nested_too_deeply_is_one_line(tmp_path):
    """PyYAML composes nested nodes recursively: a file or --set value nested
    thousands deep stopped kvtrain train and plan with a RecursionError traceback."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: x\nwandb:\n  tags: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match=rf"^{deep}: nested too deeply to read"):
        load_config(str(deep), [])
    with pytest.raises(ConfigError, match=r"^--set wandb.tags: the value is nested too deeply"):
        load_config(None, ["wandb.tags=" + "[" * 3000 + "]" * 3000])


@pytest.mark.parametrize("key", ["name", "data.cache_dir", "checkpoint.dir", "wandb.dir",
                                 "data.tokenizer"])
def test_a_nul_character_in_a_setting_is_one_line(tmp_path, key):
    """A NUL in a path or name was a 'ValueError: embedded null byte' traceback where
    the path was first opened (some after the run folder was made), or dropped
    silently (data.tokenizer named another file)."""
    with pytest.raises(ConfigError, match=rf"^--set: {key}: holds a NUL character"):
        load_config(None, [f'{key}="a\\0b"'])
    path = tmp_path / "c.yaml"
    section, _, leaf = key.rpartition(".")
    path.write_text((f"{section}:\n  {leaf}: \"a\\0b\"\n" if section else f'{leaf}: "a\\0b"\n'))
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: {key}: holds a NUL character"):
        load_config(str(path), [])


def test_a_split_of_one_number_is_the_training_part(tmp_path):
    """``split: 100`` (Megatron-LM's ``--split 100``) is a number to YAML: it was
    refused as "expected str"; it is the split '100', in files and in --set."""
    path = write(tmp_path, "data:\n  split: 100\ntrain:\n  eval_interval: null\n")
    assert load_config(str(path), []).data.split == "100"
    assert load_config(None, ["data.split=100", "train.eval_interval=null"]).data.split == "100"
    assert load_config(None, ["data.split=99.5,0.5"]).data.split == "99.5,0.5"
    assert load_config(str(path), ["data.split=99.5"]).data.split == "99.5"
    assert to_dict(load_config(str(path), []))["data"]["split"] == "100"
    # a number with no validation part and validations asked for: the split's own line
    with pytest.raises(ConfigError, match="data.split '100' has no validation part"):
        load_config(None, ["data.split=100", "train.eval_interval=5"])
    with pytest.raises(ConfigError, match="data.split must be up to three"):
        load_config(None, ["data.split=1e20"])
    with pytest.raises(ConfigError, match="data.split"):
        load_config(None, ["data.split=true"])


def test_micro_batches_the_interleaved_schedule_cannot_split_are_one_line():
    """parallel.virtual_pipeline on a world size that leaves 3 micro batches per step
    for PP 2: megatron's interleaved schedule runs them in groups of PP."""
    sets = ["model.num_layers=4", "parallel.pipeline=2", "parallel.virtual_pipeline=2",
            "train.micro_batch_size=1", "train.global_batch_size=3"]
    assert load_config(None, sets).parallel.virtual_pipeline == 2  # no world size: not checked
    with pytest.raises(ConfigError) as e:
        load_config(None, sets, world_size=2)
    assert str(e.value) == (
        "the interleaved schedule needs the micro batches per step (3 = "
        "train.global_batch_size / (train.micro_batch_size x DP 1)) to be a multiple of "
        "parallel.pipeline (2)")
    assert load_config(None, sets[:-1] + ["train.global_batch_size=4"], world_size=2)


def test_a_checkpoint_without_a_saved_config_resumes_without_comparing():
    """A checkpoint of another tool (no kvtrain config in it) is not refused as
    "saved by a different run": there is nothing to compare."""
    from kvtrain.config.compat import check_resume_config

    current = to_dict(load_config(None, ["train.max_steps=null", "train.train_tokens=2560"]))
    for saved in (None, {}):
        assert check_resume_config(saved, current, [], "checkpoint x") == []

