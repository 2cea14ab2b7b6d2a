"""A warm interpreter for the child processes tests launch: torch, Lightning and the other heavy libraries are imported
once, and each child is a fork of that interpreter instead of a fresh one.

Most of the suites' time is interpreters starting (importing torch, Lightning, torchmetrics and, through it,
transformers costs seconds of CPU per process, and the suites start hundreds of processes). The conftest starts this
server once per suite (`start`) and points `sys.executable` at `tests/warm_client.py`, copied beside the server's
socket: every `[sys.executable, ...]` a test, a launcher (torchrun, Lightning's subprocess launcher) or a child
starts goes through it. The client sends its command line, environment, working directory and open file descriptors;
the server forks; the fork takes them over and runs the command as `python` would (`-m`, `-c` or a script), with
`sys.executable` still the client, so its own children are warm too. The client mirrors the fork: signals sent to
it are forwarded, and it exits with the fork's status (a signal included); if the client dies, the server kills the
fork's process group.

What a fork shares with the server is only what was imported before the request: the project itself
(`lightning_trn`, the stand-in, torch_xla) is imported by each child after it took the test's environment. A child
runs cold (the real interpreter, as before) where a fork could differ from a fresh process: a variable read at import
time differs from the server's (`warm_client.IMPORT_TIME_PREFIXES`), interpreter flags other than `-u`/`-B`, `-m pip`
or `venv`, a child started in a session of its own (tests kill those as a process group), or
`LIGHTNING_TRN_TEST_COLD=1` (set it for a whole run to compare). docs/contributing.md says how to use it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
import types
from collections.abc import Sequence
from pathlib import Path

#: imported once by the server: what nearly every child imports, and nothing that reads the test's environment at
#: import time in a way a child could change (the project, the stand-in and torch_xla are left to each child)
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.run",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "lightning",
    "lightning.pytorch",
    "lightning.fabric",
    "torchmetrics",
    "transformers",
    "safetensors.torch",
    "omegaconf",
    "pandas",
)
CLIENT_SOURCE = Path(__file__).with_name("warm_client.py")
#: one line per child forked warm (`summary` counts them; the client writes `cold.log` beside it)
WARM_LOG = "{directory}/warm.log"
#: beside the socket: the server's interpreter flags and its namespaces (the client reads them), and the site
#: directory it adds
FLAGS_FILE, NAMESPACES_FILE, SITE_FILE = "flags", "namespaces.json", "site"
_POLL_S = 0.01


def start(
    directory: Path, flags: Sequence[str] = (), site: Path | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path]:
    """Start the server in the background for this interpreter and environment; returns it and the client to use
    as `sys.executable`. Until the server is ready, the client runs the real interpreter.

    `flags`: interpreter flags the server runs with (`-S`: no site-packages); the client forks only for commands
    that give exactly these, and runs the others cold. `site`: a site directory the server adds before its imports
    (with `-S`, the only one). `env`: the server's environment, by default this process's."""
    directory.mkdir(parents=True, exist_ok=True)
    client = directory / "python"
    source = CLIENT_SOURCE.read_text().replace("@REAL_PYTHON@", sys.executable)
    client.write_text(f"#!{sys.executable} -SE\n{source}")
    client.chmod(0o755)
    (directory / FLAGS_FILE).write_text(" ".join(flags))
    if site is not None:
        (directory / SITE_FILE).write_text(str(site))
    with open(directory / "server.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, *flags, __file__, str(directory)],
            env={**(os.environ if env is None else env), "LIGHTNING_TRN_TEST_COLD": "1"},  # its own children: cold
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return server, client


def namespaces() -> dict[str, str]:
    """This process's Linux namespaces (mount, network, ...): a fork has the server's, so a client in another one (a
    test's node in a mount namespace of its own, `unshare -m`) runs cold."""
    return {name: os.readlink(f"/proc/self/ns/{name}") for name in sorted(os.listdir("/proc/self/ns"))}


def stop(server: subprocess.Popen) -> None:
    """End the server and every fork still running (each in its own session, killed through the server)."""
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()


def summary(directory: Path) -> str:
    """How many children started warm and how many cold, and why (the client's reasons), for the run's report."""
    warm = (directory / "warm.log").read_text().splitlines() if (directory / "warm.log").exists() else []
    cold = (directory / "cold.log").read_text().splitlines() if (directory / "cold.log").exists() else []
    reasons: dict[str, int] = {}
    for line in cold:
        reason = line.split("\t", 1)[0]
        reasons[reason] = reasons.get(reason, 0) + 1
    listed = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items(), key=lambda item: -item[1]))
    return f"warm interpreter: {len(warm)} children forked warm, {len(cold)} started cold" + (
        f" ({listed})" if listed else ""
    )


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _take_descriptors(received: list[int], targets: list[int]) -> None:
    """Give the fork the client's descriptors under the client's numbers (its stdio, and any passed on)."""
    spare = [fcntl.fcntl(fd, fcntl.F_DUPFD, 512) for fd in received]  # out of the way of every target number
    for fd in received:
        os.close(fd)
    for fd, target in zip(spare, targets, strict=True):
        os.dup2(fd, target)
    for fd in spare:
        os.close(fd)


def _run(request: dict, client: str, base_path: list[str]) -> None:
    """Become the client's command in this fork, run it and exit as `python` would (never returns)."""
    argv = list(request["argv"])
    unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
    while argv[0] in ("-u", "-B", "-S"):  # `-S` only reaches a server that runs with it (the client checks)
        unbuffered |= argv.pop(0) == "-u"
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=stream is sys.stderr or os.isatty(stream.fileno()), write_through=unbuffered)
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        first = os.getcwd()
    elif argv[0] == "-c":
        first = ""
    else:
        first = os.path.dirname(os.path.realpath(argv[0]))
    sys.path[:] = [first, *pythonpath, *base_path]
    sys.executable = client
    parent = request["ppid"]
    os.getppid = lambda: parent  # the process that started the client, as a fresh child's parent would be
    if "multiprocessing" in sys.modules:
        sys.modules["multiprocessing"].set_executable(client)
    if "OMP_NUM_THREADS" in os.environ and "torch" in sys.modules:  # OpenMP read it when the server loaded torch
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    import runpy

    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]  # what `python -m` runs
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop_:
        code = _exit_code(stop_.code)
    except BaseException:  # noqa: BLE001  any uncaught exception ends the child as it ends `python`
        sys.excepthook(*sys.exc_info())
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as interpreter exit does
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 8, 250)
    while len(header) < 8:
        header += conn.recv(8 - len(header))
    length, data = int.from_bytes(header, "little"), b""
    while len(data) < length:
        chunk = conn.recv(length - len(data))
        if not chunk:
            raise ConnectionError("the client went away mid-request")
        data += chunk
    return json.loads(data), fds


def serve(directory: Path) -> None:
    if (directory / SITE_FILE).exists():
        import site

        site.addsitedir((directory / SITE_FILE).read_text())
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001  a library this environment lacks or cannot import: each child tries itself
            print(f"warm_python: not preloaded: {name}: {err!r}", flush=True)
    # what a child's environment is compared with: the suite's, plus what the imports above set (torch sets
    # CUDA_MODULE_LOADING, say), which a fresh child's imports would set too
    (directory / NAMESPACES_FILE).write_text(json.dumps(namespaces()))
    (directory / "env.json.new").write_text(json.dumps(dict(os.environ)))
    os.rename(directory / "env.json.new", directory / "env.json")
    client = str(directory / "python")
    base_path = sys.path[1:]
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry in base_path:
            base_path.remove(entry)
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / "sock.new"))
    listener.listen(128)
    os.rename(directory / "sock.new", directory / "sock")  # clients connect only once it listens
    print(f"warm_python: ready, {threading.active_count()} thread(s)", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    forks: dict[int, socket.socket] = {}  # fork pid -> its client's connection
    try:
        _loop(listener, selector, forks, parent, client, base_path)
    finally:
        for pid in forks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _kill_job(pid: int, origins: dict[int, int]) -> None:
    """SIGKILL fork `pid`'s process group and, first, every fork its processes started (their clients ran in its
    group), and theirs: what killing a cold job's process group does at once, since each fork has a session of its
    own. A rank that kills its job's group (`killpg`) kills the forks of the other ranks' clients too, before the
    server reports the rank's death to its client."""
    for child, origin in list(origins.items()):
        if origin == pid and child != pid:
            _kill_job(child, origins)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _origin(request: dict) -> int:
    """The process group the client was started from (a fork's group where a fork launched it), or 0."""
    try:
        return os.getpgid(request["ppid"])
    except OSError:
        return 0


def _loop(
    listener: socket.socket,
    selector: selectors.BaseSelector,
    forks: dict[int, socket.socket],
    parent: int,
    client: str,
    base_path: list[str],
) -> None:
    origins: dict[int, int] = {}  # fork pid -> the group its client was started from
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=_POLL_S):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    os.setsid()
                    selector.close()
                    listener.close()
                    conn.close()
                    for other in forks.values():
                        other.close()
                    _take_descriptors(fds, request["fds"])
                    _run(request, client, base_path)
                for fd in fds:
                    os.close(fd)
                with open(WARM_LOG.format(directory=os.path.dirname(client)), "a") as log:
                    log.write(f"{' '.join(request['argv'][:2])[:200]}\n")
                forks[pid] = conn
                origins[pid] = _origin(request)
                with contextlib.suppress(OSError):
                    conn.sendall(f"{pid}\n".encode())
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a client's end closed: it died (it sends nothing else), so its fork goes too
                with contextlib.suppress(OSError):
                    if key.fileobj.recv(1):
                        continue
                selector.unregister(key.fileobj)
                _kill_job(key.data, origins)
        while forks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                _kill_job(pid, origins)  # its group was killed, maybe: the forks it started go before it is reported
            origins.pop(pid, None)
            conn = forks.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{status}\n".encode())
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(conn)
                conn.close()


if __name__ == "__main__":
    try:
        serve(Path(sys.argv[1]))
    except Exception:
        traceback.print_exc()
        raise
