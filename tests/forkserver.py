"""A process that has imported what many test subprocesses import (torch, megatron,
kvtrain: ~7-8 s of CPU each time) and forks one child per request, which runs the
request's Python source like a fresh ``python -c`` would: with the request's
environment, working folder and output files; at its end it waits for its other
threads and runs its atexit functions, as the interpreter does; its exit code is
answered. One server per preamble and pytest process (the Triton
interpreter's checks; the test driver's single-process plans).

Requests and replies are JSON and text lines on the server's stdin and stdout:
the server answers the child's pid as soon as it has forked, then its exit code.
A child asked for a ``session`` of its own gets one (``setsid``): what it leaves
behind is killed with its process group once it has exited, as the tests' other
launches are.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]

SERVER = r"""
import atexit, json, os, sys, traceback
requests, replies = os.fdopen(os.dup(0)), os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDONLY)  # a child reading stdin must not read requests
os.dup2(null, 0)
os.close(null)
os.dup2(2, 1)  # and what the preamble prints must not read as a reply
exec(compile(sys.argv[1], "<preamble>", "exec"), {"__name__": "__preamble__"})
for line in requests:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            requests.close()
            replies.close()
            if request["session"]:
                os.setsid()
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                sink = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(sink, fd)
                os.close(sink)
            try:
                exec(compile(request["source"], "<request>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:
                traceback.print_exc()
            import threading
            threading._shutdown()  # as the interpreter ends: its other threads first,
            atexit._run_exitfuncs()  # then the atexit functions
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    replies.write(f"{pid}\n")
    replies.flush()
    replies.write(f"{os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}\n")
    replies.flush()
"""

# Variables the preambles' imports (Python, torch, Triton, megatron) may read as they
# load: a request setting one differently gets a server started with its value.
_READ_AT_IMPORT = ("PYTHON", "TORCH", "PYTORCH", "TRITON", "CUDA", "NVTE", "NCCL", "OMP_",
                   "MKL_", "KMP_", "LD_")


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


class NoExitCode(Exception):
    """A child past its time (killed, with its server), or a server that died (its
    preamble failed: what it printed is on the test's stderr). ``.why`` says which,
    ``.done`` holds the child's output."""

    def __init__(self, done: Done, timeout: float, died: Optional[int] = None):
        self.why = (f"no exit code in {timeout:g} s" if died is None else
                    f"the server exited ({died}) before answering: its output is above")
        super().__init__(f"{self.why}: {done.stderr[-3000:]}")
        self.done = done


def _pump(stream, lines: queue.Queue) -> None:
    """Each line of ``stream`` into ``lines``, stripped; "" at its end."""
    with contextlib.suppress(ValueError, OSError):  # closed under it: the server stopped
        for line in stream:
            lines.put(line.strip())
    lines.put("")


def _read_at_import(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_IMPORT)}


class ForkServer:
    """Runs sources in children forked from one server process that ran ``preamble``
    with ``env``. Each child runs with its request's environment; one whose variables
    read at import (``_READ_AT_IMPORT``) differ from the server's gets a server started
    with them, so that no import saw an environment the call did not give."""

    def __init__(self, preamble: str):
        self.preamble = preamble
        self._proc: Optional[subprocess.Popen] = None
        self._env: Optional[dict] = None
        self._lines: Optional[queue.Queue] = None  # the server's replies, read by a thread
        self._read: Optional[subprocess.Popen] = None  # the server they are read from

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _server(self, env: dict) -> subprocess.Popen:
        if self._proc is not None and not (self._alive() and self.serves(env)):
            self.stop()
        if self._proc is None:
            self._proc = subprocess.Popen([sys.executable, "-c", SERVER, self.preamble],
                                          cwd=REPO, env=env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True,
                                          start_new_session=True)  # its children: one group
            self._env = _read_at_import(env)
        return self._proc

    def serves(self, env: dict) -> bool:
        """Whether a request with ``env`` would be forked from the running server (or
        start the first one) rather than from a server started anew."""
        return not self._alive() or _read_at_import(env) == self._env

    def stop(self) -> None:
        """Kills the server and the children still in its group."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
            self._proc = None

    def _reply(self, timeout: float) -> Optional[str]:
        """The next line, "" once the server has closed its end, None after ``timeout``.
        A thread reads the lines: a wait on the pipe itself would not see a second line
        that the first one's read took into its buffer (the pid and the exit code of a
        child that ends at once arrive together)."""
        if self._read is not self._proc:
            self._read, self._lines = self._proc, queue.Queue()
            threading.Thread(target=_pump, args=(self._proc.stdout, self._lines),
                             daemon=True).start()
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def run(self, source: str, env: dict, cwd: Path = REPO, timeout: float = 600,
            session: bool = False) -> Done:
        """``python -c source`` with ``env`` in ``cwd``, forked from the server."""
        server = self._server(env)
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            server.stdin.write(json.dumps({"source": source, "env": env, "cwd": str(cwd),
                                           "stdout": str(out), "stderr": str(err),
                                           "session": session}) + "\n")
            server.stdin.flush()
            pid = self._reply(timeout)  # the fork: once the preamble's imports are done
            code = self._reply(timeout) if pid else pid
            if pid and session:  # what the child left behind (its own group)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(pid), signal.SIGKILL)
            died = server.wait(30) if "" in (pid, code) else None  # the server ended
            if not code:  # past its time, or a server that died: a fresh one next
                self.stop()
            done = Done(int(code) if code else -9, out.read_text() if out.exists() else "",
                        err.read_text() if err.exists() else "")
        if not code:
            raise NoExitCode(done, timeout, died)
        return done
