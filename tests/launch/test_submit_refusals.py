"""``kvtrain submit`` refusals in-process, without SLURM: option values out of
range, no sbatch on PATH, and an installed kvtrain run outside its checkout
(launch/slurm.sbatch found from the working folder, or not at all)."""

from __future__ import annotations

import pytest

from kvtrain.cli import main
from kvtrain.commands import submit

from .conftest import REPO, TINY


@pytest.mark.parametrize("option, value", [("--nodes", "0"), ("--chain", "0"),
                                           ("--gpus-per-node", "-1")])
def test_counts_out_of_range_are_one_line(capsys, tmp_path, option, value):
    """--nodes 0, --chain 0 or --gpus-per-node -1: one line, nothing submitted."""
    assert main(["submit", str(TINY), "--gpus-per-node", "0", "--run-dir", str(tmp_path / "r"),
                 option, value, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert err == ("kvtrain: config error: --nodes and --chain must be >= 1 and "
                   "--gpus-per-node >= 0\n") and out == ""
    assert not (tmp_path / "r").exists()


def test_no_sbatch_on_path_is_one_line_before_anything_is_written(capsys, tmp_path, monkeypatch):
    """``kvtrain submit`` on a machine without SLURM (a workstation): one line
    naming sbatch, exit 1, and no log folder made in the run folder."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    run = tmp_path / "run"
    assert main(["submit", str(TINY), "--gpus-per-node", "0", "--run-dir", str(run)]) == 1
    assert capsys.readouterr().err == ("kvtrain submit: sbatch not found (is this a SLURM "
                                       "login node?)\n")
    assert not run.exists()


def test_an_installed_kvtrain_finds_the_sbatch_script_in_the_working_folder(capsys, tmp_path,
                                                                              monkeypatch):
    """kvtrain installed outside its checkout (not editable): launch/slurm.sbatch
    is the working folder's; run anywhere else, one line saying where to run it."""
    monkeypatch.setattr(submit, "__file__", str(tmp_path / "site" / "kvtrain" / "commands" /
                                                "submit.py"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    args = ["submit", str(TINY), "--gpus-per-node", "0", "--run-dir", str(tmp_path / "r"),
            "--dry-run"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == ("kvtrain submit: launch/slurm.sbatch not found (run from the "
                            "kvtrain checkout)")
    assert capsys.readouterr().out == "" and not (tmp_path / "r").exists()
    checkout = tmp_path / "checkout"
    (checkout / "launch").mkdir(parents=True)
    (checkout / "launch" / "slurm.sbatch").write_text((REPO / "launch" /
                                                        "slurm.sbatch").read_text())
    monkeypatch.chdir(checkout)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"--chdir={checkout} " in out and f" {checkout}/launch/slurm.sbatch " in out, out
