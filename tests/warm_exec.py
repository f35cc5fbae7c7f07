"""The `python` of warm-started runs: tests/warm_start.py installs it beside the interpreter as `python-warm` (run
by that interpreter, with -S) and sets it as sys.executable in the runs it starts.

A run's own `python -m project.X|tests.X|torch.distributed.run ARGS` (Lightning's launcher starting ranks 1 to N-1,
torchrun starting its workers) and a loader's forkserver come here (warm_command). Instead of importing torch and
Lightning again, it asks the warm-start server
named by WARM_START_SOCKET to fork the module's process, with this process's standard streams, working directory,
environment and file-size limit, and stands in for it: signals it receives are passed on, a SIGKILL of this process
ends that one too (it watches this one), and this process ends as that one ended (its exit code, or killed by the
same signal). Any other command runs the real interpreter. Run with -S: the standard library only, in milliseconds.
"""

import os
import pickle
import resource
import signal
import socket
import sys

REAL = sys.executable  # the shebang's interpreter
# Interpreter flags a warm process does without: unbuffered streams (it has them), no bytecode written (multiprocessing
# passes on the tests' PYTHONDONTWRITEBYTECODE so).
UNFELT_FLAGS = ("-u", "-B")
TORCHRUN = "torch.distributed.run"
FORKSERVER = "from multiprocessing.forkserver import main; main("
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGABRT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def warm_command(argv: list[str]) -> dict | None:
    """What to ask the server for: `[-u] [-B] -m project.X|tests.X|torch.distributed.run ARGS`, or a loader's
    forkserver (multiprocessing's `-c "from multiprocessing.forkserver import main; ..."`); None for any other."""
    args = list(argv)
    while args and args[0] in UNFELT_FLAGS:
        args.pop(0)
    if len(args) >= 2 and args[0] == "-m" and (args[1].split(".")[0] in ("project", "tests") or args[1] == TORCHRUN):
        return {"module": args[1], "args": args[2:]}
    if len(args) == 2 and args[0] == "-c" and args[1].startswith(FORKSERVER):
        return {"code": args[1]}
    return None


def is_ignored(sig: signal.Signals) -> bool:
    try:
        return signal.getsignal(sig) == signal.SIG_IGN
    except (OSError, ValueError):
        return False


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def main() -> None:
    command = warm_command(sys.argv[1:])
    path = os.environ.get("WARM_START_SOCKET")
    if command is None or not path:
        os.execv(REAL, [REAL, *sys.argv[1:]])
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    umask = os.umask(0o022)
    os.umask(umask)
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if is_open(fd)]  # not the listing's own, closed by now
    request = {
        **command,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "umask": umask,
        "file_size_limit": None if limit == resource.RLIM_INFINITY else limit,
        "shim": os.getpid(),
        "parent": os.getppid(),  # whose end kills that process once it asks for it (PR_SET_PDEATHSIG)
        "orig_argv": sys.argv,
        "targets": fds,
        # Ignored signals stay ignored across exec (a loader's forkserver is started so): the same there.
        "ignored": [int(sig) for sig in signal.valid_signals() if is_ignored(sig)],
    }
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.connect(path)
    socket.send_fds(server, [pickle.dumps(request)], fds)
    _, pid = pickle.loads(server.recv(4096))

    def forward(sig: int, _frame: object) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        if not is_ignored(sig):
            signal.signal(sig, forward)
    message = server.recv(4096)
    if not message:  # the server ended before the run did
        os._exit(1)
    _, (_, code) = pickle.loads(message)
    if code < 0:  # ended by a signal: so does this process, for its parent to read
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


main()
