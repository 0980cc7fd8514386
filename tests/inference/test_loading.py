"""``kvtrain.inference.loading``: what a user names resolves to one complete
checkpoint, and every bad source is one line (ConfigError), never a traceback."""

from __future__ import annotations

import pytest

from kvtrain.config import ConfigError
from kvtrain.inference.loading import find_checkpoint, load_model, saved_config
from tests.hf.helpers import build, model_config, run_config


@pytest.fixture
def run_dir(mp1, tmp_path):
    """A run folder holding one weights-only checkpoint named by ``latest``."""
    from kvtrain.hf.importer import save_weights

    cfg = run_config(model_config(num_layers=1))
    path = save_weights(build(cfg, scramble=False), cfg,
                        tmp_path / "run" / "checkpoints" / "iter_0000000")
    (path.parent / "latest").write_text(path.name + "\n")
    return tmp_path / "run"


def test_sources_resolve(run_dir):
    ckpt = run_dir / "checkpoints" / "iter_0000000"
    for source in (run_dir, run_dir / "checkpoints", ckpt):
        assert find_checkpoint(source) == ckpt
    cfg, iteration = saved_config(ckpt)
    assert (cfg.model.num_layers, iteration) == (1, 0)
    assert load_model(run_dir, backend="local").config.model.num_layers == 1


def test_bad_sources_are_one_line(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "iter_0000000"
    with pytest.raises(ConfigError, match="no such run folder or checkpoint"):
        find_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no complete kvtrain checkpoint"):
        load_model(tmp_path / "empty")
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated
    with pytest.raises(ConfigError, match="is damaged"):
        find_checkpoint(ckpt)
    with pytest.raises(ConfigError, match="every complete checkpoint is damaged .*iter_0000000"):
        find_checkpoint(run_dir)  # the only checkpoint is damaged
    (ckpt / "common.pt").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="cannot read its common state"):
        saved_config(ckpt)
    for error in (find_checkpoint, saved_config):
        try:
            error(tmp_path / "nowhere")
        except ConfigError as e:
            assert "\n" not in str(e)
        except Exception as e:  # saved_config of a missing folder
            pytest.fail(f"{error.__name__}: not a one-line ConfigError: {e!r}")


def test_checkpoint_dir_elsewhere_and_no_latest(run_dir, tmp_path):
    """A run whose config.yaml names its checkpoint.dir elsewhere resolves there;
    without ``latest``, the newest complete checkpoint is taken."""
    elsewhere = tmp_path / "store"
    (run_dir / "checkpoints").rename(elsewhere)
    (elsewhere / "latest").unlink()
    (run_dir / "config.yaml").write_text(f"checkpoint:\n  dir: {elsewhere}\n")
    assert find_checkpoint(run_dir) == elsewhere / "iter_0000000"


def test_a_damaged_latest_falls_back_with_a_warning(run_dir, capsys):
    """The newest checkpoint damaged: the previous complete one is used, and said."""
    import shutil

    ckpt = run_dir / "checkpoints" / "iter_0000000"
    newer = ckpt.with_name("iter_0000005")
    shutil.copytree(ckpt, newer)
    (newer.parent / "latest").write_text(newer.name + "\n")
    shard = next(newer.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])
    assert find_checkpoint(run_dir) == ckpt
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvtrain: warning: checkpoint ") and "iter_0000005 is damaged" in line
    assert line.endswith(f"using {ckpt}")


def test_a_run_folder_with_a_broken_config_or_latest_still_resolves(run_dir):
    """A run folder whose config.yaml cannot be read (not YAML, or a list), and whose
    ``latest`` names a checkpoint folder that is not complete (no marker: a copy in
    progress): the checkpoints/ folder is searched, and its newest complete
    checkpoint is found."""
    ckpt = run_dir / "checkpoints" / "iter_0000000"
    (ckpt.parent / "iter_0000009").mkdir()
    (ckpt.parent / "latest").write_text("iter_0000009\n")
    for text in ("checkpoint: [dir\n", "- checkpoint\n"):
        (run_dir / "config.yaml").write_text(text)
        assert find_checkpoint(run_dir) == ckpt


def test_a_checkpoint_not_saved_by_kvtrain_is_one_line(run_dir):
    """A torch_dist checkpoint whose common state holds no kvtrain config (Megatron-LM's
    holds ``args``): ``saved_config`` (what kvtrain generate and kvtrain eval read
    first) names the checkpoint in one line."""
    import torch

    ckpt = run_dir / "checkpoints" / "iter_0000000"
    torch.save({"args": None, "iteration": 3}, ckpt / "common.pt")
    with pytest.raises(ConfigError, match=f"^checkpoint {ckpt} has no kvtrain config "
                                          "\\(not saved by kvtrain\\)$"):
        saved_config(ckpt)


def test_every_checkpoint_of_a_checkpoint_is_itself_and_of_nothing_one_line(run_dir, tmp_path,
                                                                           capsys):
    """``perplexity --checkpoints all``'s list: a checkpoint named itself is the
    list; a folder with none, or with only damaged ones, is one line."""
    from kvtrain.inference.loading import every_checkpoint

    ckpt = run_dir / "checkpoints" / "iter_0000000"
    assert every_checkpoint(ckpt) == [ckpt] == every_checkpoint(run_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'empty'} holds no complete kvtrain "
                                          f"checkpoint$"):
        every_checkpoint(tmp_path / "empty")
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # the only checkpoint, damaged: passed over
    with pytest.raises(ConfigError, match="holds no complete kvtrain checkpoint"):
        every_checkpoint(run_dir)
    assert f"checkpoint {ckpt} is damaged" in capsys.readouterr().err
