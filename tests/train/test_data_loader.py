"""The trainer's micro-batch iterators (kvtrain/data/loader.py) and the processes
of their loader workers (``data.num_workers`` > 0) at the end of a process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.train.conftest import REPO

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from kvtrain.data import micro_batches

    class Numbers(torch.utils.data.Dataset):
        def __len__(self):
            return 100

        def __getitem__(self, i):
            return {"tokens": torch.tensor([i])}

    def step(iterators):  # the training loop's frame holds its iterators
        print(next(iterators[0])["tokens"].tolist(), flush=True)
        if sys.argv[1] == "crash":
            raise RuntimeError("CUDA out of memory (as a step fails)")

    iterators = [micro_batches(Numbers(), 0, 2, 0, 1, num_workers=1)]
    step(iterators)
""")


@pytest.mark.parametrize("end", ["crash", "return"])
def test_a_process_with_loader_workers_exits(tmp_path, end):
    """A step that raised (a CUDA out-of-memory error, a failed collective) with
    ``data.num_workers`` 1, the default: the rank printed its traceback, then hung
    forever at its exit (also a script ending with an iterator alive). The workers
    ignore SIGTERM (SLURM sends it to every process of the job, for the trainer to
    save), and Python's exit ends its child processes with SIGTERM, then waits for
    them: a torchrun job hung until its time limit instead of failing. Now the
    workers are stopped first, and the process ends."""
    script = tmp_path / "loader.py"
    script.write_text(SCRIPT)
    try:
        done = subprocess.run([sys.executable, str(script), end], cwd=REPO, timeout=60,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still running after 60 s: {e.stdout!r}")
    assert done.stdout.splitlines()[0] == "[[0], [1]]", done.stdout
    if end == "crash":
        assert done.returncode == 1 and "CUDA out of memory" in done.stderr, done.stderr[-2000:]
    else:
        assert done.returncode == 0, done.stderr[-2000:]
