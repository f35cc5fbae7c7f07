"""`python -m MODULE ARGS` started warm: as a process forked from one that has imported torch, Lightning, Hydra and
litdata already, so that a test's run starts in a tenth of a second instead of after two to three seconds of imports.

The child is a process of its own, as `python -m` would start it: its own session (the tests kill a run's whole
session), its own standard streams, working directory and environment, `sys.argv` and a `__main__` module that
runpy gives the module (Lightning re-launches the same `python -m` command for a run's other ranks), and a normal
interpreter exit (atexit handlers, flushed streams). What differs is only what a fresh interpreter would have done
before the module ran: the imports are done, and what they printed (a library's warning at import) was printed
by the server, not by the run. Tests that assert on a start's imports or its console as a whole start cold
(`run_module(..., warm=False)`).

One server per pytest worker (tests/conftest.py), which serves one run at a time; the requests travel over a
Unix socket with the run's standard output and error as file descriptors.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
# What `python -m project.*` imports before it does anything of its own: the server imports it once. Not
# project.train itself: runpy would warn that the module it runs as __main__ was imported already.
WARM_IMPORTS = ("torch", "lightning.pytorch", "hydra", "omegaconf", "litdata", "project.training.run")


class WarmProcess:
    """The handle of a warm-started run, as much of subprocess.Popen as the tests use."""

    def __init__(self, server: WarmServer, pid: int, stdout: IO[str], stderr: IO[str]):
        self.server, self.pid, self.returncode = server, pid, None
        self._read = {"stdout": stdout, "stderr": stderr}
        self._text: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [threading.Thread(target=self._drain, args=(name,), daemon=True) for name in self._read]
        for reader in self._readers:
            reader.start()

    def _drain(self, name: str) -> None:
        with self._read[name] as stream:
            for chunk in iter(lambda: stream.read(65536), ""):
                self._text[name].append(chunk)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self.server.exit_code(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"warm {self.pid}", timeout or 0)
            self.returncode = code
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the run to end and for its streams to close (a process outside its session, as wandb's service,
        may hold them open longer); what it printed so far. subprocess.TimeoutExpired as Popen's."""
        self.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(f"warm {self.pid}", timeout or 0, *self.printed())
        return self.printed()

    def printed(self) -> tuple[str, str]:
        return "".join(self._text["stdout"]), "".join(self._text["stderr"])


class WarmServer:
    """The test side: starts the server process, asks it for runs."""

    def __init__(self, root: Path = ROOT) -> None:
        """A server that imports from the repository at `root` (another copy of it, for a test of a fresh copy)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
        env.pop("PYTEST_CURRENT_TEST", None)
        # What the imports print (a library's warning) is not any run's: it goes to a file of its own.
        self.log = tempfile.NamedTemporaryFile(prefix="warm-start-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_start", str(theirs.fileno())],
            cwd=root,
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        theirs.close()
        self.socket, self.lock, self.ended = ours, threading.Lock(), dict[int, int]()

    def start(
        self, module: str, args: list[str], cwd: Path, env: dict[str, str], file_size_limit: int | None = None
    ) -> WarmProcess:
        """`python -m module args` in `cwd` with `env`; `file_size_limit`: writes past it fail as on a full disk."""
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            umask = os.umask(0o022)  # this process's, which a child of its own would inherit
            os.umask(umask)
            request = pickle.dumps(
                {
                    "module": module,
                    "args": args,
                    "cwd": str(cwd),
                    "env": env,
                    "umask": umask,
                    "file_size_limit": file_size_limit,
                }
            )
            socket.send_fds(self.socket, [request], [out_write, err_write])
        finally:
            os.close(out_write)
            os.close(err_write)
        with self.lock:
            while True:  # the end of an earlier run may come first
                kind, value = self._receive()
                if kind == "started":
                    pid = value
                    break
                self.ended[value[0]] = value[1]
        return WarmProcess(self, pid, open(out_read, errors="replace"), open(err_read, errors="replace"))

    def _receive(self) -> tuple[str, object]:
        message = self.socket.recv(4096)
        if not message:
            raise RuntimeError(f"the warm-start server ended: see {self.log.name}")
        return pickle.loads(message)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The run's exit code (negative: killed by that signal) once it has ended; None if not within `timeout`."""
        with self.lock:
            self.socket.settimeout(timeout)
            try:
                while pid not in self.ended:
                    _, (ended, code) = self._receive()
                    self.ended[ended] = code
            except (TimeoutError, BlockingIOError):
                return None
            finally:
                self.socket.settimeout(None)
        return self.ended[pid]

    def close(self) -> None:
        self.socket.close()  # the server reads end-of-file and exits
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


_server_pid = os.getpid()
_exit_code = 0


def _leave_without_finalizing() -> None:
    """A child's last exit handler (registered before any import's, so it runs after all of them): end the process
    without tearing down the modules one by one, a second or more with torch loaded, which the server's imports
    would add to every run that a fresh interpreter of the same command would not have had."""
    if os.getpid() != _server_pid:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(_exit_code)


_shared: WarmServer | None = None


def shared_server() -> WarmServer:
    """This process's server (one per pytest worker), started on first use."""
    global _shared
    if _shared is None or _shared.process.poll() is not None:  # a test may have signalled it away
        _shared = WarmServer()
    return _shared


def close_shared_server() -> None:
    if _shared is not None:
        _shared.close()


def serve(fd: int) -> None:
    """The server: imports once, then forks one child per request and reports when it ends."""
    import atexit
    import importlib

    atexit.register(_leave_without_finalizing)
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    connection = socket.socket(fileno=fd)
    while True:
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
        if not message:
            return
        request = pickle.loads(message)
        pid = os.fork()
        if pid == 0:
            connection.close()
            run_child(request, fds)  # returns only by leaving the interpreter, as `python -m` does
        for fd_ in fds:
            os.close(fd_)
        connection.send(pickle.dumps(("started", pid)))
        _, status = os.waitpid(pid, 0)
        connection.send(pickle.dumps(("ended", (pid, os.waitstatus_to_exitcode(status)))))


def run_child(request: dict, fds: list[int]) -> None:
    import faulthandler
    import runpy

    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
        os.dup2(source, target)
        os.close(source)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # PYTHONUNBUFFERED, as the tests' runs have it
    if request["file_size_limit"]:  # an error from write() (EFBIG), not a signal that kills
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (request["file_size_limit"],) * 2)
    os.umask(request["umask"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()  # on the run's stderr
    sys.argv = [request["module"], *request["args"]]
    sys.orig_argv = [sys.executable, "-m", request["module"], *request["args"]]  # the command, as a run records it
    sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
    global _exit_code
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:  # as the interpreter reads it
        if stop.code is None or isinstance(stop.code, int):
            _exit_code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            _exit_code = 1
    except BaseException:
        traceback.print_exc()
        _exit_code = 1
    sys.exit(_exit_code)  # the interpreter's exit: threads joined, exit handlers run, then ours


if __name__ == "__main__":
    serve(int(sys.argv[1]))
