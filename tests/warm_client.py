"""The `python` that tests launch children with: hands the command to the warm interpreter (`tests/warm_python.py`),
which forks a child that already imported torch and Lightning, or runs the real interpreter where a fork would not
be the same as a fresh process.

`tests/warm_python.py` copies this file beside the warm interpreter's socket with a shebang naming the real
interpreter and `-SE` (no site, no environment: this file needs the standard library only, so it starts in
milliseconds). It must stay that way: standard library only, no import of the project.
"""

import json
import os
import signal
import socket
import sys

REAL_PYTHON = "@REAL_PYTHON@"  # the real interpreter, written in when the file is copied
HERE = os.path.dirname(os.path.abspath(__file__))
#: variables that torch, Lightning or transformers read at import time: a child whose value differs from the warm
#: interpreter's runs cold (torch and torch_xla set others at import, e.g. PYTORCH_NVML_BASED_CUDA_CHECK, which
#: torch reads only at run time: those may differ)
IMPORT_TIME_PREFIXES = (
    "TORCH_",
    "TORCHDYNAMO",
    "TORCHINDUCTOR",
    "PYTORCH_JIT",
    "MKL_",
    "ATEN_CPU_CAPABILITY",  # read once, at the first dispatch: a fork would keep the warm interpreter's kernels
    "KMP_",
    "OPENBLAS",
    "GOTO",
    "CUDA_VISIBLE",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS",
    "LD_",
    "MALLOC",
    "PYTHONHASHSEED",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONWARNINGS",
    "PYTHONOPTIMIZE",
    "PYTHONSTARTUP",
    "PYTHONHOME",
    "PYTHONNOUSERSITE",
    "PYTHONUSERBASE",
    "PYTHONSAFEPATH",
    "PYTHONDEVMODE",
    "PYTHONUTF8",
    "PYTHONIOENCODING",
    "PYTHONFAULTHANDLER",
    "LC_",
    "LANG",
)
#: read at run time only: torchrun sets them for its workers
RUN_TIME_PREFIXES = ("TORCH_NCCL_",)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)


def cold(reason: str) -> None:
    """Run the real interpreter instead, noting why in `cold.log` beside the socket."""
    try:
        with open(os.path.join(HERE, "cold.log"), "a") as log:
            log.write(f"{reason}\t{' '.join(sys.argv[1:3])[:200]!r}\n")
    except OSError:
        pass
    os.execv(REAL_PYTHON, [REAL_PYTHON, *sys.argv[1:]])


def server_flags() -> set:
    """The interpreter flags the warm interpreter runs with (`-S` for one without site-packages)."""
    try:
        with open(os.path.join(HERE, "flags")) as f:
            return set(f.read().split())
    except OSError:
        return set()


def warm_command(args: list, flags: set) -> bool:
    """Whether `python ARGS` is a form the warm child runs exactly: `[-u] [-B] (-m module | -c code | script) ...`,
    with exactly the warm interpreter's own `flags` among the leading ones (`-S`)."""
    given = set()
    while args and args[0] in ("-u", "-B", *flags):
        given |= {args[0]} & flags
        args = args[1:]
    if not args or given != flags:
        return False
    if args[0] in ("-m", "-c"):
        return len(args) > 1 and not (args[0] == "-m" and args[1] in ("pip", "venv", "ensurepip"))
    return not args[0].startswith("-")


def import_environment_difference() -> str:
    """The variables read at import time whose values differ from the warm interpreter's ("" when none do)."""
    try:
        with open(os.path.join(HERE, "env.json")) as f:
            warm = json.load(f)
    except OSError:
        return "no env.json"
    names = {
        n for n in (*warm, *os.environ) if n.startswith(IMPORT_TIME_PREFIXES) and not n.startswith(RUN_TIME_PREFIXES)
    }
    return " ".join(sorted(n for n in names if warm.get(n) != os.environ.get(n)))


def namespace_difference() -> str:
    """The Linux namespaces (mount, network, ...) this process does not share with the warm interpreter: its fork
    would see the server's mounts, not this process's ("" when it shares them all)."""
    try:
        with open(os.path.join(HERE, "namespaces.json")) as f:
            warm = json.load(f)
    except OSError:
        return "no namespaces.json"
    return " ".join(name for name, link in sorted(warm.items()) if os.readlink(f"/proc/self/ns/{name}") != link)


def main() -> None:
    # a child in a session of its own (a job a test or the job itself kills as a process group) is warm too: the
    # fork has a session the server made, and dies with its client; a fork killed by SIGKILL takes the forks its
    # processes started with it (`warm_python._kill_job`). Anything asked to runs cold (LIGHTNING_TRN_TEST_COLD=1).
    if os.environ.get("LIGHTNING_TRN_TEST_COLD"):
        cold("asked to")
    if not warm_command(sys.argv[1:], server_flags()):
        cold("command form")
    if not os.path.exists(os.path.join(HERE, "env.json")):  # the server writes it when its imports are done
        cold("not ready")
    difference = import_environment_difference()
    if difference:
        cold(f"environment: {difference}")
    difference = namespace_difference()
    if difference:
        cold(f"namespace: {difference}")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.path.join(HERE, "sock"))
    except OSError:  # not up (yet, or any more)
        cold("not ready")
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd != conn.fileno():
            try:
                os.fstat(fd)
            except OSError:  # the directory listing's own descriptor, closed by now
                continue
            fds.append(fd)
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds, "ppid": os.getppid()}
    request = json.dumps(request).encode()
    socket.send_fds(conn, [len(request).to_bytes(8, "little")], fds)
    conn.sendall(request)
    reader = conn.makefile("r")
    pid = int(reader.readline())

    def forward(signum: int, _frame: object) -> None:
        os.kill(pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    line = reader.readline()
    if not line:  # the warm interpreter died: say so like a killed child
        sys.exit(1)
    status = int(line)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:  # which has no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status))


main()
