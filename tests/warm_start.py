"""`python -m MODULE ARGS` started warm: as a process forked from one that has imported torch, Lightning, Hydra and
litdata already, so that a test's run starts in a tenth of a second instead of after two to three seconds of imports.

The child is a process of its own, as `python -m` would start it: its own session (the tests kill a run's whole
session), its own standard streams, working directory and environment, `sys.argv` and a `__main__` module that
runpy gives the module (Lightning re-launches the same `python -m` command for a run's other ranks), and a normal
interpreter exit (atexit handlers, flushed streams). What differs is only what a fresh interpreter would have done
before the module ran: the imports are done, and what they printed (a library's warning at import) was printed
by the server, not by the run. Tests that assert on a start's imports or its console as a whole start cold
(`run_module(..., warm=False)`).

One server per pytest worker (tests/conftest.py); the requests travel over a Unix socket with the run's standard
output and error as file descriptors, and their processes run side by side (the ranks of tests/in_process.py).
A run's own `python -m` commands start warm too: its sys.executable is a shim (tests/warm_exec.py) that asks the
same server, so that Lightning's launcher and torchrun start ranks 1 to N-1 warm, and a loader's forkserver
finds its imports done. Such a process is not in the run's session but watches its shim, and goes when it goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import pickle
import select
import shutil
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
        self.folder = Path(tempfile.mkdtemp(prefix="warm-start-"))
        install_shim()
        # Listening before the server has started: a shim that asks early waits in the queue.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(self.folder / "socket"))
        listener.listen(64)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_start", str(theirs.fileno()), str(listener.fileno())],
            cwd=root,
            env=env,
            pass_fds=[theirs.fileno(), listener.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        theirs.close()
        listener.close()
        self.socket, self.lock, self.ended = ours, threading.Lock(), dict[int, int]()

    def python(self) -> tuple[str, dict[str, str]]:
        """The interpreter and the variable that start `python -m project.X` warm from this server, for a command
        that a launcher of its own runs (horovodrun, torchrun, srun): the shim, WARM_START_SOCKET."""
        return str(SHIM), {"WARM_START_SOCKET": str(self.folder / "socket")}

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
        shutil.rmtree(self.folder, ignore_errors=True)


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


def serve(fd: int, listening: int) -> None:
    """The server: imports once, then forks one child per request and reports when each ends. Requests come from
    the test (over `fd`) and from runs' own `python -m` commands (the shim, over the socket at WARM_START_SOCKET);
    their children run side by side, as a run's ranks must."""
    import atexit
    import importlib

    atexit.register(_leave_without_finalizing)
    listener = socket.socket(fileno=listening)
    socket_path = listener.getsockname()
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    connection = socket.socket(fileno=fd)
    asking: set[socket.socket] = set()  # shims that have connected and not yet sent their request
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, where to report its end)
    try:
        while True:
            readable, _, _ = select.select([connection, listener, *asking, *running], [], [])
            for ready in readable:
                if ready is listener:
                    asking.add(listener.accept()[0])
                    continue
                if isinstance(ready, int):  # a child ended
                    pid, reply = running.pop(ready)
                    os.close(ready)
                    _, status = os.waitpid(pid, 0)
                    with contextlib.suppress(OSError):  # a shim killed meanwhile has closed its end
                        reply.send(pickle.dumps(("ended", (pid, os.waitstatus_to_exitcode(status)))))
                    if reply is not connection:
                        reply.close()
                    continue
                message, fds, _, _ = socket.recv_fds(ready, 1 << 20, 64)
                if ready is not connection:
                    asking.discard(ready)
                if not message:
                    if ready is connection:  # the tests are done
                        return
                    ready.close()
                    continue
                closed_in_child = [connection, listener, ready, *asking, *(reply for _, reply in running.values())]
                pid = os.fork()
                if pid == 0:
                    for other in closed_in_child:
                        other.close()
                    for pidfd in running:
                        os.close(pidfd)
                    run_child(pickle.loads(message), fds, socket_path)  # returns only by leaving
                for fd_ in fds:
                    os.close(fd_)
                ready.send(pickle.dumps(("started", pid)))
                running[os.pidfd_open(pid)] = (pid, ready)
    finally:
        if os.getpid() == _server_pid:  # not in a child, which leaves through here (SystemExit)
            listener.close()


SHIM = Path(sys.executable).with_name("python-warm")


def install_shim() -> None:
    """Write the `python` that warm children see as sys.executable (tests/warm_exec.py behind this interpreter's
    path), where `python -m` commands started by a run (Lightning's other ranks, torchrun's workers) find it."""
    text = f"#!{sys.executable} -S\n" + Path(__file__).with_name("warm_exec.py").read_text()
    if SHIM.exists() and SHIM.read_text() == text:
        return
    staged = SHIM.with_name(f".python-warm-{os.getpid()}")
    staged.write_text(text)
    staged.chmod(0o755)
    os.replace(staged, SHIM)  # whole, whichever pytest worker's server writes it


def run_child(request: dict, fds: list[int], socket_path: str) -> None:
    import faulthandler
    import multiprocessing
    import runpy
    import types

    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    for sig in request.get("ignored", []):
        signal.signal(sig, signal.SIG_IGN)
    # The descriptors at the numbers the command had them: the test passes its stdout and stderr (stdin is
    # /dev/null), a shim all of its own (a forkserver's command names its two).
    targets = request.get("targets") or [1, 2]
    fds = [*fds, os.open(os.devnull, os.O_RDONLY)] if 0 not in targets else fds
    targets = [*targets, 0] if 0 not in targets else targets
    apart = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]  # above every target, then each to its place
    for fd in fds:
        os.close(fd)
    for fd, target in zip(apart, targets):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("shim"):
        # Started for a shim (tests/warm_exec.py) that stands in for this process in its parent's eyes: when the
        # shim is killed (SIGKILL, which it cannot pass on), this process and its own children go too; and once
        # this process asks Linux to be killed with its parent (PR_SET_PDEATHSIG: project.runtime.processes), it
        # is killed when the shim's parent ends. The pidfds go above the numbers the command's descriptors take.
        shim, parent = (_pidfd_above(pid, 1000) for pid in (request["shim"], request["parent"]))
        sys.addaudithook(_note_parent_death_signal)
        threading.Thread(target=_end_with, args=(shim, parent), daemon=True).start()
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
    os.environ["WARM_START_SOCKET"] = socket_path  # where the shim finds this server
    sys.executable = str(SHIM)  # as `python -m` a run starts (Lightning's, torchrun's) goes through it
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()  # on the run's stderr
    multiprocessing.set_executable(sys.executable)  # a loader's forkserver, too
    # The command, as a run records it.
    sys.orig_argv = request.get("orig_argv") or [sys.executable, "-m", request["module"], *request["args"]]
    global _exit_code
    try:
        if "code" in request:  # `python -c CODE`
            sys.argv, sys.path[0] = ["-c"], ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [request["module"], *request["args"]]
            sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
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


def _pidfd_above(pid: int, lowest: int) -> int:
    """A descriptor that reads ready once process `pid` has ended, numbered `lowest` or above."""
    try:
        opened = os.pidfd_open(pid)
    except ProcessLookupError:  # ended already (a run refused at once, before its forkserver started)
        opened, written = os.pipe()
        os.close(written)  # end of file: ready at once, as the pidfd of an ended process
    moved = fcntl.fcntl(opened, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(opened)
    return moved


_PR_GET_PDEATHSIG = 2
_parent_death_signal = 0  # what this process asked for with PR_SET_PDEATHSIG, seen by _note_parent_death_signal
_prctl_looked_up = False
_prctl = ctypes.CDLL(None).prctl
_main_thread = threading.get_ident()


def _note_parent_death_signal(event: str, args: tuple) -> None:
    """An audit hook that notes the signal this process asks for on its parent's death (prctl(PR_SET_PDEATHSIG)
    through ctypes: project.runtime.processes). Linux keeps it per thread, out of the watcher's sight, and Python
    audits the lookup of prctl, not the call: the next event on the main thread after a lookup reads it."""
    global _parent_death_signal, _prctl_looked_up
    if event == "ctypes.dlsym" and args[1] == "prctl":
        _prctl_looked_up = True
    elif _prctl_looked_up and threading.get_ident() == _main_thread:
        _prctl_looked_up = False
        asked = ctypes.c_int(0)
        _prctl(_PR_GET_PDEATHSIG, ctypes.byref(asked), 0, 0, 0)
        _parent_death_signal = _parent_death_signal or asked.value


def _end_with(shim: int, parent: int) -> None:
    """The shim's watcher in its process: the shim's end ends this process's group; the shim's parent's end sends
    this process the signal it asked for on its parent's death, once it has asked."""
    while True:
        asked = _parent_death_signal
        ready, _, _ = select.select([shim, parent] if asked else [shim], [], [], None if asked else 0.2)
        if shim in ready:
            os.kill(0, signal.SIGKILL)  # this process's group: the run's process and its loader workers
        if parent in ready:
            os.kill(os.getpid(), asked)
            return


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
