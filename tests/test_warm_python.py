"""The warm interpreter tests launch children from (`tests/warm_python.py`): a warm child is the command run as
`python` runs it (arguments, environment, working directory, standard streams, passed descriptors, exit status and
signals), and a child that a fork could not run exactly runs cold."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import xla_free_python

pytestmark = pytest.mark.both

#: prints whether torch was imported before the command ran: true only in a fork of the warm interpreter
WARM_PROBE = "import sys; print('warm' if 'torch' in sys.modules else 'cold')"


@pytest.fixture(scope="module")
def warm_ready() -> None:
    directory = os.environ.get("LIGHTNING_TRN_WARM_PYTHON")
    if not directory:
        pytest.skip("children start cold in this run (LIGHTNING_TRN_TEST_COLD is set)")
    deadline = time.monotonic() + 300
    while not Path(directory, "sock").exists():
        assert time.monotonic() < deadline, Path(directory, "server.log").read_text()
        time.sleep(0.2)


def _python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, **kwargs)


def test_a_warm_child_runs_the_command_as_python_would(warm_ready: None, tmp_path: Path) -> None:
    code = (
        "import os, sys; print(open(0).read()); print(sys.argv[1:], os.getcwd(), os.environ['PROBE_VAR']);"
        "print(sys.path[0] == ''); print('torch' in sys.modules); print(os.getppid());"
        "sys.stderr.write('to stderr'); sys.exit(3)"
    )
    run = _python("-c", code, "a", "b", cwd=tmp_path, env={**os.environ, "PROBE_VAR": "42"}, input="from stdin")
    assert run.returncode == 3
    assert run.stdout.splitlines() == ["from stdin", f"['a', 'b'] {tmp_path} 42", "True", "True", str(os.getpid())]
    assert run.stderr == "to stderr"


def test_modules_and_scripts_get_their_argv_and_path(warm_ready: None, tmp_path: Path) -> None:
    script = tmp_path / "tool.py"
    script.write_text("import sys; print(sys.argv); print(sys.path[0]); print(__name__)")
    run = _python(str(script), "x", cwd=tmp_path)
    assert run.stdout.splitlines() == [str([str(script), "x"]), str(tmp_path), "__main__"]
    (tmp_path / "pkgmod.py").write_text("import sys; print(sys.argv[1:], __name__)")
    run = _python("-m", "pkgmod", "y", cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.stdout.split() == ["['y']", "__main__"]


def test_an_uncaught_exception_and_a_signal_end_the_child_as_they_end_python(warm_ready: None) -> None:
    run = _python("-c", "raise ValueError('boom')")
    assert run.returncode == 1 and "ValueError: boom" in run.stderr
    assert _python("-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)").returncode == -signal.SIGTERM


def test_signals_reach_the_child_and_its_client_dying_ends_it(warm_ready: None, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    for stop in (signal.SIGTERM, signal.SIGKILL):
        pid_file.unlink(missing_ok=True)
        client = subprocess.Popen([sys.executable, "-c", code])
        while not pid_file.exists() or not pid_file.read_text():
            assert client.poll() is None
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert child != client.pid  # the command runs in the fork, not in the client
        client.send_signal(stop)
        assert client.wait(timeout=30) == -stop
        deadline = time.monotonic() + 30
        while _runs(child):
            assert time.monotonic() < deadline, f"the fork outlived its client after {stop!r}"
            time.sleep(0.05)


def _runs(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie; one that is reaped while its stat is read is gone (reading
    /proc after an exists() check raced with the reaping: a flaky failure)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_passed_descriptors_arrive_under_their_numbers(warm_ready: None) -> None:
    read, write = os.pipe()
    try:
        run = _python("-c", f"import os; os.write({write}, b'through the pipe')", pass_fds=(write,))
        os.close(write)
        assert run.returncode == 0, run.stderr
        assert os.read(read, 100) == b"through the pipe"
    finally:
        os.close(read)


@pytest.mark.parametrize(
    ("case", "kwargs", "args"),
    [
        ("asked to", {"env": {**os.environ, "LIGHTNING_TRN_TEST_COLD": "1"}}, ()),
        ("import-time variable", {"env": {**os.environ, "PYTHONHASHSEED": "7"}}, ()),
        ("interpreter flag", {}, ("-I",)),
    ],
)
def test_what_a_fork_could_not_run_exactly_runs_cold(warm_ready: None, case: str, kwargs: dict, args: tuple) -> None:
    assert _python("-c", WARM_PROBE).stdout.strip() == "warm"
    run = _python(*args, "-c", WARM_PROBE, **kwargs)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "cold", case


def test_the_interpreter_without_torch_xla_forks_only_for_its_own_flags(warm_ready: None, tmp_path: Path) -> None:
    """The XLA suite's second warm interpreter (`python -S` on a site without torch_xla) serves
    `tests/xla_free_python.py`: its forks have torch loaded and no torch_xla to find; a command without `-S` (which
    would see site-packages) runs cold there, and one with `-S` runs cold at the main interpreter (which has them)."""
    directory = os.environ.get(xla_free_python.WARM_VARIABLE)
    if directory is None:
        pytest.skip("the native suite has no torch_xla to leave out")
    deadline = time.monotonic() + 300
    while not Path(directory, "sock").exists():
        assert time.monotonic() < deadline, Path(directory, "server.log").read_text()
        time.sleep(0.2)
    run = xla_free_python.run_without_torch_xla(
        f"{WARM_PROBE}; import importlib.util; print(importlib.util.find_spec('torch_xla') is None)", tmp_path
    )
    assert run.stdout.split() == ["warm", "True"], run.stderr
    free_python = os.path.join(directory, "python")
    run = subprocess.run([free_python, "-c", WARM_PROBE], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "cold", run.stderr
    assert _python("-S", "-c", WARM_PROBE).stdout.strip() == "cold"


def test_a_job_killed_by_sigkill_takes_the_forks_it_started_before_its_death_is_reported(
    warm_ready: None, tmp_path: Path
) -> None:
    """A job in a session of its own (as tests start one that kills itself) is warm, and when it dies of SIGKILL
    (its `killpg`, or the test's), every fork its processes started (another rank) is dead before the test sees its
    exit: a cold job's group holds every rank, but a fork has a session of its own. The rank here is started in a
    session of its own, so its client outlives the job's `killpg`, and only this rule takes the rank down."""
    pid_file = tmp_path / "pid"
    rank = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    job = (
        "import os, signal, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True, stdout=subprocess.DEVNULL, "
        "stderr=subprocess.DEVNULL)\n"
        f"while not os.path.exists({str(pid_file)!r}) or not open({str(pid_file)!r}).read(): time.sleep(0.01)\n"
        "print('warm' if 'torch' in sys.modules else 'cold', flush=True)\n"
        "os.killpg(os.getpgrp(), signal.SIGKILL)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", job], capture_output=True, text=True, timeout=120, start_new_session=True
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert run.stdout.strip() == "warm"
    assert _dead_or_dying(int(pid_file.read_text())), "the other rank's fork outlived the job"


def _dead_or_dying(pid: int) -> bool:
    """Whether `pid` can run no more code: gone, a zombie, exiting (`PF_EXITING` in its flags) or with SIGKILL
    pending (a killed process takes a moment to be scheduled and exit)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    sigkill = 1 << (signal.SIGKILL - 1)
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & 0x4) or any(mask & sigkill for mask in pending)


def test_a_child_in_a_mount_namespace_of_its_own_runs_cold(warm_ready: None) -> None:
    """A fork has the server's mounts: a child started in a mount namespace of its own (a test's node with a
    node-local disk, `unshare -m`) would not see its own mounts in a fork."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("cannot make a mount namespace here (`unshare -m` needs root)")
    run = subprocess.run(["unshare", "-m", sys.executable, "-c", WARM_PROBE], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "cold"
