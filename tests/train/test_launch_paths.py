"""The tests' launch helpers where CUDA is visible.

On the lent H200 every one-process launch of the trainer tests failed with
"Cannot re-initialize CUDA in forked subprocess": they were children of the
import server (``tests/forkserver.py``), whose imports had initialised CUDA.
With CUDA visible, ``run`` and ``run_driver`` start fresh processes instead.
"""

from __future__ import annotations


from . import conftest
from .conftest import run, run_driver


def test_with_cuda_visible_no_launch_forks_from_the_import_server(monkeypatch, tmp_path):
    def forked(*args, **kwargs):
        raise AssertionError("a launch forked from the import server")

    monkeypatch.setattr(conftest, "_cuda_visible", lambda: True, raising=False)
    monkeypatch.setattr(conftest._SERVER, "run", forked)
    helped = run(["--help"], timeout=120)
    assert helped.returncode == 0 and "usage: kvtrain" in helped.stdout
    driven = run_driver([], tmp_path / "plan.json", timeout=120)
    assert driven.returncode == 0, driven.stderr[-2000:]


def test_with_cuda_visible_the_driver_forks_before_its_imports(monkeypatch, tmp_path):
    """The driver's jobs fork from it: with CUDA visible it must not do the imports
    that initialise CUDA first (each child makes them)."""
    from kvtrain import testing

    from . import driver

    def imported():
        raise AssertionError("the driver imported before forking")

    monkeypatch.setattr(testing, "cuda_visible", lambda: True)
    monkeypatch.setattr(driver, "prepare", imported)
    monkeypatch.setattr(driver, "run_plan", lambda plan: 0)
    assert driver.main(str(tmp_path / "plan.json")) == 0


def test_a_port_taken_before_torchrun_listens_is_a_new_launch(monkeypatch):
    """``free_port`` finds a port free, then torchrun binds it: a process of the suite
    taking it in between failed the launch in torchrun's own store (EADDRINUSE, no
    rank started; seen once in a full run as a 2-rank refusal test with no line
    at all). ``run`` launches again on another port; a rank's own failure is not
    retried."""
    from ..scripts import a_taken_port_first

    with a_taken_port_first(monkeypatch, conftest):
        helped = run(["--help"], nproc=2, timeout=120)
    assert helped.returncode == 0 and helped.stdout.count("usage: kvtrain") == 2, \
        helped.stderr[-2000:]
    failed = run(["no-such-command"], nproc=2, timeout=120)
    assert failed.returncode != 0 and "invalid choice" in failed.stderr
