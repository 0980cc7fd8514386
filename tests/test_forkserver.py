"""The tests' fork server (``tests/forkserver.py``): each request runs like a fresh
``python -c`` with its own environment, folder, output and exit code; a child in a
session of its own leaves nothing behind; a child past its time is killed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .forkserver import ForkServer, NoExitCode

PROBE = ("import json, os, sys\n"
         "print(json.dumps({'pid': os.getpid(), 'ppid': os.getppid(), 'cwd': os.getcwd(),\n"
         "                  'probe': os.environ.get('PROBE'), 'stdin': sys.stdin.read(),\n"
         "                  'preamble': 'PREAMBLE_RAN' in os.environ}))\n")


@pytest.fixture
def server():
    s = ForkServer("import json, os\nos.environ['PREAMBLE_RAN'] = '1'\n")
    yield s
    s.stop()


def _probe(server, env, cwd):
    import json

    done = server.run(PROBE, env, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_each_request_gets_its_environment_folder_and_a_process_of_its_own(server, tmp_path):
    env = dict(os.environ, PROBE="first")
    first = _probe(server, env, tmp_path)
    second = _probe(server, dict(env, PROBE="second"), Path("/"))
    assert (first["probe"], second["probe"]) == ("first", "second")
    assert (first["cwd"], second["cwd"]) == (str(tmp_path), "/")
    assert first["pid"] != second["pid"] and first["ppid"] == second["ppid"]  # one server
    assert first["stdin"] == "" and not first["preamble"]  # /dev/null; the request's env


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may take its time)."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in "ZX":
            return False
        time.sleep(0.1)
    return True


def test_exit_codes_and_tracebacks_are_the_childs(server):
    env = dict(os.environ)
    assert server.run("import sys\nsys.exit(3)", env).returncode == 3
    assert server.run("print('out')\nraise SystemExit('why')", env).returncode == 1
    failed = server.run("import atexit\natexit.register(print, 'at exit')\n"
                        "raise ValueError('the check failed')", env)
    assert failed.returncode == 1 and "ValueError: the check failed" in failed.stderr
    assert failed.stdout == "at exit\n"  # its atexit functions ran
    # as at the interpreter's end: its threads are waited for, then atexit runs
    ended = server.run("import atexit, threading, time\n"
                       "atexit.register(print, 'at exit')\n"
                       "threading.Thread(target=lambda: (time.sleep(0.5), print('thread'))).start()",
                       env)
    assert ended.returncode == 0 and ended.stdout == "thread\nat exit\n", ended


def test_a_variable_read_at_import_gets_a_server_started_with_it(server):
    env = dict(os.environ)
    ppid = lambda e: _probe(server, e, Path("/"))["ppid"]  # noqa: E731
    first = ppid(env)
    assert ppid(dict(env, PROBE="other")) == first  # not read by any import
    assert ppid(dict(env, TORCH_LOGS="+dynamo")) != first


def test_a_session_child_leaves_nothing_and_one_past_its_time_is_killed(server, tmp_path):
    env = dict(os.environ)
    pid_file = tmp_path / "sleeper"
    done = server.run("import subprocess\n"
                      f"p = subprocess.Popen(['sleep', '300'])\nopen({str(pid_file)!r}, 'w')"
                      ".write(str(p.pid))\n", env, session=True)
    assert done.returncode == 0, done.stderr
    assert not _running(int(pid_file.read_text()))
    started = time.monotonic()
    with pytest.raises(NoExitCode) as late:
        server.run("import time\nprint('started', flush=True)\ntime.sleep(300)", env,
                   timeout=1, session=True)
    assert time.monotonic() - started < 30 and late.value.done.stdout == "started\n"
    assert server.run("pass", env).returncode == 0  # a fresh server


def test_a_server_whose_preamble_fails_says_so():
    broken = ForkServer("raise ImportError('no such module')\n")
    with pytest.raises(NoExitCode, match=r"the server exited \(1\) before answering"):
        broken.run("pass", dict(os.environ), timeout=60)


def test_two_replies_already_in_the_pipe_are_both_read(tmp_path):
    """The pid and the exit code of a child that ends at once can reach the pipe
    together; reading the first must not leave the second in a buffer a wait on the
    pipe does not see (``make test`` hung there for the 600 s timeout, then failed)."""
    import subprocess
    import sys

    written = tmp_path / "written"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nprint('123'); print('0'); sys.stdout.flush()\n"
         f"open({str(written)!r}, 'w').close()\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not written.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        server = ForkServer("")
        server._proc = proc  # a server that has answered both lines and lives on
        assert server._reply(5) == "123"
        assert server._reply(5) == "0"
        assert server._reply(0.2) is None  # nothing more: the wait's timeout
    finally:
        proc.kill()
        proc.wait()
