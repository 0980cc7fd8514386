"""``kvtrain submit`` option values it used to accept or ignore (a zero signal
margin, a zero or negative time limit, empty names), what a failed submission
leaves behind, and the usage a subcommand's stray arguments are reported with."""

from __future__ import annotations

import argparse

import pytest

from kvtrain.cli import build_parser, main

from .conftest import TINY


def dry_submit(tmp_path, *options: str) -> int:
    return main(["submit", str(TINY), "--gpus-per-node", "0", "--run-dir", str(tmp_path / "r"),
                 *options, "--dry-run"])


NO_LIMIT = "SLURM reads it as no time limit: leave --time out for the partition's default"


@pytest.mark.parametrize("options, message", [
    (["--signal-seconds", "0"], "--signal-seconds must be >= 1 (the seconds the trainer has to "
                                "save before the time limit), got 0"),
    (["--time", "0"], f"--time '0' is zero: {NO_LIMIT}"),
    (["--time", "00:00"], f"--time '00:00' is zero: {NO_LIMIT}"),
    (["--time", "0-0:0:0"], f"--time '0-0:0:0' is zero: {NO_LIMIT}"),
    (["--time", "-1"], f"--time '-1' is negative: {NO_LIMIT}"),
    (["--time", "-30"], "--time '-30' is negative: a time limit is minutes, MM:SS, HH:MM:SS, "
                        "D-HH, D-HH:MM or D-HH:MM:SS"),
    (["--time", "5", "--signal-seconds", "300"], "--signal-seconds 300 is not shorter than "
                                                 "--time 5 (300 s)"),
    # slurm.sbatch mounts them only into a container: taken, and nothing mounted (a probe's)
    (["--container-mounts", "/data:/data"], "--container-mounts /data:/data: mounts are a "
                                            "container's (give --container-image)"),
])
def test_submit_refuses_a_non_positive_margin_or_time_limit(capsys, tmp_path, options, message):
    """--signal-seconds 0 signals at the kill, with no time to save; SLURM reads
    --time 0 or -1 as no limit, not as the short job it looks like."""
    assert dry_submit(tmp_path, *options) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"kvtrain: config error: {message}") and err.count("\n") == 1, err
    assert out == "" and not (tmp_path / "r").exists()


@pytest.mark.parametrize("time", ["UNLIMITED", "infinite", "1", "0:30", "0-1"])
def test_submit_accepts_an_explicit_no_limit_and_short_limits(capsys, tmp_path, time):
    assert dry_submit(tmp_path, "--time", time, "--signal-seconds", "10") == 0
    assert f"--time={time} " in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--job-name", "--partition", "-p", "--account", "--qos",
                                    "--time", "--container-image", "--container-mounts",
                                    "--run-dir", "--sbatch-arg"])
@pytest.mark.parametrize("value", ["", " "])
def test_submit_refuses_an_empty_value_in_one_line(capsys, tmp_path, option, value):
    """An empty --job-name or --partition was dropped: the job went out under the
    default name, to the default partition, without a word."""
    named = {"-p": "--partition"}.get(option, option)
    assert dry_submit(tmp_path, option, value) == 2
    out, err = capsys.readouterr()
    assert err == (f"kvtrain: config error: {named} {value!r} is empty (leave it out for "
                   "the default)\n") and out == ""


def fake_sbatch(tmp_path, monkeypatch, script: str) -> None:
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.parent.mkdir()
    sbatch.write_text(script)
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", str(sbatch.parent))


@pytest.mark.parametrize("script, message", [
    ("#!/bin/sh\necho 'sbatch: error: invalid partition' >&2\nexit 1\n",
     "kvtrain submit: sbatch failed: sbatch: error: invalid partition"),
    ("#!/no/such/shell\n", "kvtrain submit: cannot run sbatch: No such file or directory"),
])
def test_a_failed_submission_removes_the_folders_it_made(capsys, tmp_path, monkeypatch,
                                                         script, message):
    """sbatch refusing the job (or not starting): the run folder and its logs/ that
    submit made are gone again; a run folder that was there stays, with its files."""
    fake_sbatch(tmp_path, monkeypatch, script)
    new = tmp_path / "new" / "run"
    assert main(["submit", str(TINY), "--gpus-per-node", "0", "--run-dir", str(new)]) == 1
    assert capsys.readouterr().err.strip() == message
    assert not (tmp_path / "new").exists()
    old = tmp_path / "old"
    (old / "logs").mkdir(parents=True)
    (old / "notes").write_text("x")
    assert main(["submit", str(TINY), "--gpus-per-node", "0", "--run-dir", str(old)]) == 1
    capsys.readouterr()
    assert sorted(p.name for p in old.iterdir()) == ["logs", "notes"]  # logs/ was not ours


def test_a_chain_cut_short_keeps_the_log_folder_of_its_queued_jobs(capsys, tmp_path,
                                                                   monkeypatch):
    fake_sbatch(tmp_path, monkeypatch, f"#!/bin/sh\n[ -e {tmp_path}/one ] && exit 1\n"
                                       f": > {tmp_path}/one\necho 7\n")
    run = tmp_path / "run"
    assert main(["submit", str(TINY), "--gpus-per-node", "0", "--chain", "2", "--run-dir",
                 str(run)]) == 1
    assert "submitted and queued: 7" in capsys.readouterr().err
    assert (run / "logs").is_dir()  # job 7 writes its log there


def leaves(parser: argparse.ArgumentParser):
    """The parsers of every command under ``parser``, nested (kvtrain data merge) too."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for child in (child for action in subs for child in action.choices.values()):
        yield from leaves(child)
    if not subs:
        yield parser


def required_argv(parser: argparse.ArgumentParser) -> list[str]:
    """The fewest arguments ``parser`` accepts (a value for each required one)."""
    argv = []
    for action in parser._actions:
        value = str(sorted(action.choices)[0]) if action.choices else "1"
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            argv.append(value)
        elif action.required and action.option_strings:
            argv += [action.option_strings[0], value]
    return argv


def test_stray_arguments_are_reported_with_the_subcommands_usage(capsys):
    """`kvtrain train t.yaml extra` said `usage: kvtrain [-h] COMMAND ...` and
    `kvtrain: error: ...`: the top level's usage, which names none of train's options."""
    for leaf in leaves(build_parser()):
        words = leaf.prog.split()[1:]
        with pytest.raises(SystemExit) as e:
            main([*words, *required_argv(leaf), "--no-such-option"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"usage: {leaf.prog} "), err
        assert err.endswith(f"\n{leaf.prog}: error: unrecognized arguments: --no-such-option\n")
    with pytest.raises(SystemExit) as e:
        main(["train", str(TINY), "extra"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith("kvtrain train: error: unrecognized arguments: "
                                            "extra\n")
    with pytest.raises(SystemExit) as e:
        main(["--no-such-option", "train", str(TINY)])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith("\nkvtrain: error: unrecognized arguments: "
                                            "--no-such-option\n")
