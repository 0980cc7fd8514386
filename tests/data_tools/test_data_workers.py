"""The tokenizer worker pool of ``preprocess`` (``data_tools.workers``): results
in order, and a worker that dies or runs out of memory ends the run with one
line naming the work in flight, where ``multiprocessing.Pool`` waited forever."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dt_helpers as h  # noqa: E402
from test_data_resume import (  # noqa: E402,F401
    _children, _cmd, corpus, wait_for_a_half_written_shard,
)

from data_tools.workers import EncoderPool, WorkersFailed, encode_inline  # noqa: E402


def _item(line: int, size: int = 10):
    return SimpleNamespace(path="c.jsonl", first_line=line, payload=b"x" * size)


def _no_model(*args):  # the initializer: the tests' functions need no tokenizer
    pass


def _square_or_die(item):
    """A worker's function that dies as the OOM killer kills (SIGKILL) on line 13,
    raises MemoryError on line 17, and sleeps on line 19."""
    if item.first_line == 13:
        os.kill(os.getpid(), signal.SIGKILL)
    if item.first_line == 17:
        raise MemoryError()
    if item.first_line == 19:
        time.sleep(120)
    return item.first_line ** 2


def _die_while_sending(item):
    """A worker's function whose process is SIGKILLed while it writes its result
    (what the OOM killer may do at any moment): a thread watches this thread's
    system call and kills the process once it is inside write(2) with the result."""
    thread = threading.get_native_id()

    def kill_once_writing():
        while True:
            with open(f"/proc/self/task/{thread}/syscall") as f:
                if f.read().split()[0] == "1":  # write(2): the result's bytes
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0002)

    if item.first_line == 21:
        threading.Thread(target=kill_once_writing, daemon=True).start()
        return b"x" * (256 << 20)  # many pipe buffers: the write takes a while
    return item.first_line ** 2


def _pool(workers: int = 2) -> EncoderPool:
    return EncoderPool(workers, (), function=_square_or_die, initializer=_no_model)


def test_results_come_in_order_with_a_bounded_window():
    pool = _pool()
    try:
        assert list(pool.map(_item(i) for i in range(30) if i not in (13, 17, 19))) == \
            [i * i for i in range(30) if i not in (13, 17, 19)]
    finally:
        pool.close()


def test_a_worker_killed_ends_the_run_naming_the_work_in_flight():
    pool = _pool()
    started = time.monotonic()
    try:
        with pytest.raises(WorkersFailed) as e:
            list(pool.map([_item(11), _item(12), _item(13, size=3_000_000), _item(14)]))
    finally:
        pool.terminate()
    message = str(e.value)
    assert time.monotonic() - started < 30  # before the fix: waited forever
    assert message.startswith("a tokenizer worker process was killed by SIGKILL (what the "
                              "kernel's out-of-memory killer sends: see dmesg) while "
                              "encoding c.jsonl:"), message
    assert "c.jsonl:13 (3.0 MB)" in message or "the largest c.jsonl:13 of 3.0 MB" in message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_a_worker_killed_while_writing_its_result_ends_the_run():
    """Killed halfway through sending a result: the main process saw a message cut
    short (and, under ProcessPoolExecutor, the other workers waited on the lock the
    dead one held), so the run hung forever (CI, stop 38)."""
    pool = EncoderPool(2, (), function=_die_while_sending, initializer=_no_model)
    outcome = []

    def run():
        try:
            outcome.append(list(pool.map([_item(20), _item(21), _item(22), _item(23)])))
        except WorkersFailed as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    try:
        assert not thread.is_alive(), "hung: the run did not end in 60 s"
        assert isinstance(outcome[0], WorkersFailed), outcome
        assert str(outcome[0]).startswith(
            "a tokenizer worker process was killed by SIGKILL (what the kernel's out-of-memory "
            "killer sends: see dmesg) while encoding c.jsonl:21 (10 B)"), str(outcome[0])
    finally:
        pool.terminate()


def test_a_memory_error_in_a_worker_or_inline_is_one_line():
    pool = _pool()
    try:
        with pytest.raises(WorkersFailed) as e:
            list(pool.map([_item(16), _item(17, size=2000)]))
    finally:
        pool.terminate()
    assert str(e.value) == ("a tokenizer worker ran out of memory (MemoryError) while "
                            "encoding c.jsonl:17 (2.0 kB)")
    with pytest.raises(WorkersFailed) as e:
        list(encode_inline([_item(16), _item(17, size=2000)], _square_or_die))
    assert str(e.value) == "out of memory (MemoryError) while encoding c.jsonl:17 (2.0 kB)"


def _refuse_line_5(item):
    if item.first_line == 5:
        raise ValueError("line 5 is not text")
    return item.first_line


def _no_tokenizer(*args):
    raise FileNotFoundError("spm.model")


def test_an_error_in_a_worker_or_its_initializer_is_raised_here():
    """The worker's exception itself, as the in-process path would raise it (the
    CLI turns the ones it knows into its one line)."""
    pool = EncoderPool(2, (), function=_refuse_line_5, initializer=_no_model)
    try:
        results = pool.map([_item(4), _item(5), _item(6)])
        assert next(results) == 4
        with pytest.raises(ValueError, match="line 5 is not text"):
            next(results)
    finally:
        pool.terminate()
    pool = EncoderPool(2, (), function=_refuse_line_5, initializer=_no_tokenizer)
    try:
        with pytest.raises(FileNotFoundError, match="spm.model"):
            list(pool.map([_item(4)]))
    finally:
        pool.terminate()


def test_terminate_stops_a_worker_in_the_middle_of_an_item():
    """Ctrl-C or a --strict stop: the workers stop now, not after their item."""
    pool = _pool(workers=1)
    results = pool.map([_item(18), _item(19), _item(20)])
    assert next(results) == 18 * 18
    time.sleep(0.5)  # the worker is inside item 19's two minutes
    processes = list(pool._processes.values())
    started = time.monotonic()
    pool.terminate()
    for process in processes:
        process.join(timeout=30)
    assert all(p.exitcode is not None for p in processes)
    assert time.monotonic() - started < 10


def _stopped_mid_shard(corpus, out, stop) -> tuple[int, str]:
    """Runs the CLI until shard 0 is complete and a later one half-written, then
    ``stop(pid)``: its exit code and stderr, once no temporaries are left."""
    proc = subprocess.Popen(_cmd(corpus, out / "c"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_a_half_written_shard(proc, out)
        stop(proc.pid)
        _, err = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not [n for n in os.listdir(out) if ".tmp." in n]
    assert "c_00000_text_document.meta.json" in os.listdir(out)
    return proc.returncode, err


def _resume_equals_a_run_from_scratch(corpus, out, ref) -> None:
    resumed = subprocess.run(_cmd(corpus, out / "c", "--resume"), capture_output=True,
                             text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    subprocess.run(_cmd(corpus, ref / "c"), check=True, capture_output=True, timeout=120)
    assert h.files_in(out) == h.files_in(ref)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_a_worker_killed_mid_run_is_one_line_and_resume_completes(corpus, tmp_path):
    """The CLI: one worker SIGKILLed (as the OOM killer does) while a later shard is
    half-written: exit 1 with one line (before: preprocess hung forever), no
    temporaries left, and --resume completes the run byte-identical."""
    code, err = _stopped_mid_shard(corpus, tmp_path / "out",
                                   lambda pid: os.kill(_children(pid)[0], signal.SIGKILL))
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("kvtrain data preprocess: error: a tokenizer worker process "
                               "was killed by SIGKILL"), lines[0]
    assert f"while encoding {corpus}/part" in lines[0], lines[0]
    assert lines[0].endswith("nothing was written for the shard being processed (--resume "
                             "keeps the shards completed before it)"), lines[0]
    _resume_equals_a_run_from_scratch(corpus, tmp_path / "out", tmp_path / "ref")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_sigterm_is_one_line_and_resume_completes(corpus, tmp_path):
    """SIGTERM to the job (scancel, a time limit, docker stop, kill): exit 143 with
    one line saying how to go on, and no temporaries left (before: killed without
    a word, the shard's temporaries left until the next run)."""
    # to every process of the job, as SLURM signals a step
    code, err = _stopped_mid_shard(corpus, tmp_path / "out",
                                   lambda pid: os.killpg(pid, signal.SIGTERM))
    assert code == 128 + signal.SIGTERM and err == (
        "kvtrain data preprocess: stopped by SIGTERM; nothing was written for the shard "
        "being processed (--resume keeps the shards completed before it)\n"), err
    _resume_equals_a_run_from_scratch(corpus, tmp_path / "out", tmp_path / "ref")


def test_how_the_workers_ended_in_words():
    """The dead worker is the one named, not the others (running, or ended by the
    SIGTERM of a terminate)."""
    from data_tools.workers import _how_it_ended

    def ended(*codes):
        return [SimpleNamespace(exitcode=c) for c in codes]

    assert _how_it_ended(ended(-signal.SIGTERM, -signal.SIGKILL)).startswith(
        "a tokenizer worker process was killed by SIGKILL (what the kernel's")
    assert _how_it_ended(ended(-signal.SIGSEGV, None)) == \
        "a tokenizer worker process was killed by SIGSEGV"
    assert _how_it_ended(ended(0, 3)) == "a tokenizer worker process exited with status 3"
    assert _how_it_ended(ended(-signal.SIGTERM, None)) == "a tokenizer worker process died"


def test_a_childs_end_in_words():
    """``lifeline.ended_by``: the words every kvtrain line about a child's end uses
    (the preprocess workers, the checkpoint writers, an experiment's arms)."""
    from data_tools.lifeline import ended_by, killed_by

    assert ended_by(2) == "exit 2"
    assert ended_by(-signal.SIGKILL) == ("killed by SIGKILL (what the kernel's out-of-memory "
                                         "killer sends: see dmesg)")
    assert ended_by(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert killed_by(200) == "killed by signal 200"


def test_a_stop_waits_for_the_end_of_a_held_section():
    """``stops_raise``: SIGTERM is ``Terminated`` and Ctrl-C ``KeyboardInterrupt``;
    within ``signals_held`` (a shard's commit, the cleanup) either waits for the
    end of the section, which then runs to its end (the SIGTERM test's temporaries
    were left when the stop cut a commit in two)."""
    from data_tools.lifeline import Terminated, signals_held, stops_raise

    # Python's own Ctrl-C handler, as in a terminal (a background job inherits an
    # ignored SIGINT, which stops_raise leaves ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    for sig, stop in ((signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)):
        done = []
        with stops_raise():
            with pytest.raises(stop):
                with signals_held():
                    os.kill(os.getpid(), sig)
                    time.sleep(0.05)  # the handler has run: it held the stop back
                    done.append("renamed")
            assert done == ["renamed"]
            with pytest.raises(stop):
                os.kill(os.getpid(), sig)
                time.sleep(1)  # not reached: raised at once outside a held section
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    signal.signal(signal.SIGINT, inherited)


_UNDER = """
import multiprocessing, sys
sys.path[:0] = [{tests!r}, {root!r}]
from data_tools.workers import EncoderPool, WorkersFailed
from test_data_workers import _item, _no_model, _square_or_die

if __name__ == "__main__":
    multiprocessing.set_start_method({method!r})
    pool = EncoderPool(2, (), function=_square_or_die, initializer=_no_model)
    print(list(pool.map(_item(i) for i in range(6))))
    pool.close()
    pool = EncoderPool(2, (), function=_square_or_die, initializer=_no_model)
    try:
        list(pool.map(_item(i) for i in range(11, 15)))
    except WorkersFailed as e:
        print(e)
    finally:
        pool.terminate()
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_the_pool_under_every_start_method(tmp_path, method):
    """fork is Linux's default before Python 3.14, forkserver after it; spawn is
    macOS's: results in order, and a worker's death named, under each."""
    script = tmp_path / "under.py"
    script.write_text(_UNDER.format(tests=os.path.dirname(__file__), root=str(h.ROOT),
                                    method=method))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[0, 1, 4, 9, 16, 25]"
    # the oldest item in flight: 13's, or 12's if its worker had not answered yet
    assert re.match(r"a tokenizer worker process was killed by SIGKILL \(what the kernel's "
                    r"out-of-memory killer sends: see dmesg\) while encoding c\.jsonl:1[23] "
                    r"\(10 B\)", lines[1]), done.stdout + done.stderr
