"""Run untrusted, model-written Python (e.g. a HumanEval completion plus its tests) in a throwaway process.

Code execution is hostile input: a program may loop forever, fork-bomb, allocate 50 GB, print gigabytes, fill
the disk, delete files or open sockets. :func:`run_python` runs one and nothing it starts outlives the call.

What is enforced, and where
---------------------------
Always (POSIX): a separate interpreter (``python -I``: no user site, no ``PYTHON*`` variables) whose cwd, HOME
and TMPDIR are a fresh temporary directory, deleted afterwards; a minimal environment (no inherited secrets); a
new session whose process group is SIGKILLed by the parent on the wall-clock timeout, on output overflow and as
soon as the main process exits; RLIMIT_AS, RLIMIT_CPU, RLIMIT_NPROC (processes + threads), RLIMIT_FSIZE (bytes
per file), RLIMIT_NOFILE and RLIMIT_CORE=0; stdout+stderr read as they arrive and cut at ``max_output_bytes``.

Linux as root (the intended deployment, and what the tests exercise):
  * The program runs as a fresh uid/gid drawn per run from an unused range, not ``nobody``, so that concurrent
    sandboxes neither share one RLIMIT_NPROC budget (root ignores it; this uid does not) nor can signal each
    other. It owns nothing outside its directory, so it can change nothing there. Processes that left the
    group with setsid() are killed by ``kill(-1, SIGKILL)`` sent as that uid (exactly this run's processes);
    the call returns only when none is alive.
  * A new network namespace with only a loopback that is down: no connection anywhere, 127.0.0.1 included.
  * A new mount namespace: the sandbox directory becomes a size-limited tmpfs (``max_total_bytes``, 64 MiB by
    default, and at most ``_MAX_INODES`` files), so the program's total writes are bounded — not only each
    file's size — and never reach the host's disk; the world-writable /tmp, /var/tmp, /dev/shm and /run/lock
    become bind mounts of that tmpfs (nothing can be left there, and writes there count too), and an interpreter installed below a directory others cannot
    enter (pyenv under /root, mode 0700) is exposed through a tmpfs over that directory, hiding the rest of it.
  * PR_SET_NO_NEW_PRIVS (setuid binaries cannot regain root); PR_SET_PDEATHSIG (dies if the parent dies).

Linux as an ordinary user, and other POSIX systems: no privilege drop (the program can touch whatever the user
can); RLIMIT_NPROC counts all the user's tasks, so it is set to their current count plus ``max_processes``; a
child that calls setsid() escapes the group kill. No namespaces (unprivileged user namespaces would widen the
kernel attack surface for hostile code): with ``network=False`` an audit hook refuses non-Unix sockets instead,
a speed bump that ctypes or a subprocess (``curl``) gets past. macOS ignores RLIMIT_AS; Windows is unsupported.

Nowhere enforced: reading world-readable files (the only channel out is the returned output), total disk use
when not root (only each file's size: no mount namespace, no tmpfs), CPU share (no cgroups). Orphans killed after their parent died
are reaped by PID 1; under a container init that never reaps, their zombies (dead, holding only a pid) remain.
"""

from __future__ import annotations

import ctypes
import grp
import json
import logging
import math
import os
import pwd
import random
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["SandboxResult", "SandboxStatus", "check_program", "run_python"]

logger = logging.getLogger(__name__)

SandboxStatus = Literal["passed", "failed", "timeout", "error", "killed", "output_limit"]

_PROGRAM_NAME = "main.py"
_SEARCH_PATH = "/usr/local/bin:/usr/bin:/bin"
_SETUP_EXIT_CODE = 125  # what env(1) and unshare(1) use for "the wrapper itself failed"
_SETUP_MARKER = "sandbox-setup-error:"
_UID_RANGE = (1_500_000_000, 1_600_000_000)  # far above what distributions, LDAP or containers hand out
_MAX_OPEN_FILES = 256
_MAX_INODES = 4096  # files + directories a sandboxed program may create (tmpfs nr_inodes)
_READ_CHUNK = 65_536
_POLL_S = 0.05
_DRAIN_GRACE_S = 1.0
_REAP_DEADLINE_S = 5.0
_SHARED_TMP_DIRS = ("/var/tmp", "/dev/shm", "/run/lock", "/tmp")  # /tmp last: the sandbox dir usually lives there

# linux/sched.h, linux/mount.h, linux/prctl.h
_CLONE_NEWNS, _CLONE_NEWNET = 0x0002_0000, 0x4000_0000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_MOVE, _MS_REC, _MS_PRIVATE = 2, 4, 4096, 8192, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38

# Fallback only (no network namespace): refuses socket creation, then runs the program as __main__.
_NETWORK_GUARD = """\
import _socket, sys
def _sandbox_no_network(event, args):
    if event == "socket.__new__" and args[1] != _socket.AF_UNIX:
        raise PermissionError("network access is disabled in this sandbox")
sys.addaudithook(_sandbox_no_network)
del _sandbox_no_network
import runpy
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# Run as root with the uid as argument: become it, then SIGKILL all its processes.
_KILL_ALL_OF_UID = """\
import os, sys
uid = int(sys.argv[1])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
try:
    os.kill(-1, 9)
except ProcessLookupError:
    pass
"""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    ``passed`` is True iff the program exited with status 0 within every limit. ``status`` says why not:
    ``failed`` (non-zero exit, e.g. an assertion or MemoryError), ``timeout`` (wall clock or CPU limit),
    ``killed`` (died from a signal), ``output_limit`` (printed more than allowed), ``error`` (the sandbox
    itself could not start; not the program's fault). ``returncode`` is negative for "killed by that signal"
    and None when no process ran. ``stdout``/``stderr`` hold at most ``max_output_bytes`` bytes together.
    """

    passed: bool
    status: SandboxStatus
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float


def run_python(
    program: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    cpu_s: int | None = None,
    max_output_bytes: int = 64_000,
    network: bool = False,
    max_processes: int = 64,
    max_file_bytes: int = 16 * 2**20,
    max_total_bytes: int = 64 * 2**20,
) -> SandboxResult:
    """Run ``program`` as ``__main__`` in a sandbox and report how it ended.

    ``timeout_s`` is wall-clock time enforced by this process; ``cpu_s`` (default: the timeout rounded up,
    plus one second) is RLIMIT_CPU per process. ``memory_mb`` caps the address space of each process,
    ``max_processes`` the processes and threads it may have at once, ``max_file_bytes`` the size of any
    file it writes, ``max_total_bytes`` what all its files together may hold (as root: the size of the tmpfs
    that is its directory and /tmp; a write past it fails with ENOSPC). ``network=True`` skips the network namespace (the program then reaches the host's network).
    """
    _validate_limits(timeout_s, memory_mb, cpu_s, max_output_bytes, max_processes, max_file_bytes)
    if max_total_bytes < 2**20:
        raise ValueError(f"max_total_bytes={max_total_bytes!r} is invalid; pass at least 1 MiB (1048576)")
    if sys.platform == "win32":
        raise NotImplementedError("run_python needs POSIX rlimits and process groups; run it on Linux or macOS")
    start = time.monotonic()
    error = syntax_error(program)
    if error is not None:  # the interpreter would stop here too, before running a line of it
        return SandboxResult(False, "failed", 1, "", error, time.monotonic() - start)
    sandbox_uid = _allocate_uid() if os.geteuid() == 0 else None
    workdir = Path(tempfile.mkdtemp(prefix="sandbox-"))
    try:
        (workdir / _PROGRAM_NAME).write_text(program, encoding="utf-8")
        if sandbox_uid is not None:
            os.chown(workdir, sandbox_uid, sandbox_uid)
        config = {
            "uid": sandbox_uid,
            "network": network,
            "memory_bytes": memory_mb * 2**20,
            "cpu_s": cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1,
            "nproc": _nproc_limit(max_processes, sandbox_uid),
            "file_bytes": max_file_bytes,
            "total_bytes": max_total_bytes,
        }
        command = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), json.dumps(config)]
        try:
            proc = subprocess.Popen(
                command, cwd=workdir, env={"PATH": _SEARCH_PATH}, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            )
        except OSError as exc:
            return SandboxResult(False, "error", None, "", f"could not start {command[0]}: {exc}",
                                 time.monotonic() - start)
        try:
            stop_reason, captured = _supervise(proc, start + timeout_s, max_output_bytes, sandbox_uid)
        finally:
            _kill_everything(proc, sandbox_uid)
            proc.wait()
            if sandbox_uid is not None:
                _await_uid_gone(sandbox_uid)
        stdout, stderr = (bytes(buffer).decode("utf-8", errors="replace") for buffer in captured)
        status = _classify(stop_reason, proc.returncode, stderr)
        return SandboxResult(status == "passed", status, proc.returncode, stdout, stderr, time.monotonic() - start)
    finally:
        _remove_tree(workdir)


def syntax_error(program: str) -> str | None:
    """The error the interpreter reports for a program that does not compile; None if it compiles.

    Compiling runs none of the program's code: the parser and the compiler only (constant folding
    is size-capped by CPython), so this happens in the caller's process, and a program that cannot
    run costs no sandbox (~0.15 s of CPU for two interpreter starts; a broken model's replies are
    mostly such programs). The source is compiled as the bytes the sandbox writes to its file, so
    a coding cookie or BOM reads as it would there. Anything but a clean syntax verdict (a
    RecursionError on absurd nesting, MemoryError) returns None and the sandbox decides.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning/DeprecationWarning about the program's source
            compile(program.encode("utf-8"), _PROGRAM_NAME, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: a null byte
        return "".join(traceback.format_exception_only(type(exc), exc))
    except Exception:  # noqa: BLE001 - not a verdict on the program's syntax
        return None
    return None


def check_program(program: str, **limits: Any) -> bool:
    """True iff ``program`` exits 0 within the limits; ``limits`` are :func:`run_python`'s keyword arguments."""
    return run_python(program, **limits).passed


def _validate_limits(timeout_s: float, memory_mb: int, cpu_s: int | None, max_output_bytes: int,
                     max_processes: int, max_file_bytes: int) -> None:
    checks = {
        "timeout_s": (timeout_s, timeout_s > 0, "a positive number of seconds"),
        "memory_mb": (memory_mb, memory_mb >= 64, "at least 64 (the interpreter alone needs ~20 MB)"),
        "cpu_s": (cpu_s, cpu_s is None or cpu_s >= 1, "None (derived from timeout_s) or at least 1"),
        "max_output_bytes": (max_output_bytes, max_output_bytes >= 0, "zero or more bytes"),
        "max_processes": (max_processes, max_processes >= 1, "at least 1 (the program itself)"),
        "max_file_bytes": (max_file_bytes, max_file_bytes >= 0, "zero or more bytes"),
    }
    for name, (value, ok, wanted) in checks.items():
        if not ok:
            raise ValueError(f"{name}={value!r} is invalid; pass {wanted}")


def _supervise(proc: subprocess.Popen[bytes], deadline: float, max_output_bytes: int,
               sandbox_uid: int | None) -> tuple[str | None, tuple[bytearray, bytearray]]:
    """Collect output until the program exits, times out or overflows; then kill everything and drain."""
    assert proc.stdout is not None and proc.stderr is not None
    captured = (bytearray(), bytearray())
    selector = selectors.DefaultSelector()
    for index, stream in enumerate((proc.stdout, proc.stderr)):
        os.set_blocking(stream.fileno(), False)
        selector.register(stream.fileno(), selectors.EVENT_READ, index)
    total = 0
    stop_reason: str | None = None

    def read_ready(wait_s: float) -> None:
        nonlocal total, stop_reason
        for key, _ in selector.select(timeout=wait_s):
            chunk = os.read(key.fd, _READ_CHUNK)
            if not chunk:
                selector.unregister(key.fd)
                continue
            captured[key.data].extend(chunk[: max(0, max_output_bytes - total)])
            total += len(chunk)
            if total > max_output_bytes and stop_reason is None:
                stop_reason = "output_limit"

    try:
        while stop_reason is None and not _has_exited(proc):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stop_reason = "timeout"
                break
            if selector.get_map():
                read_ready(min(_POLL_S, remaining))
            else:
                time.sleep(min(0.005, remaining))
        _kill_everything(proc, sandbox_uid)
        drain_until = time.monotonic() + _DRAIN_GRACE_S
        while selector.get_map() and time.monotonic() < drain_until:
            read_ready(_POLL_S)
    finally:
        selector.close()
    return stop_reason, captured


def _has_exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the main process ended, without reaping it: while unreaped its pid still names our group."""
    if not hasattr(os, "waitid"):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere (someone called os.wait())
        return True


def _kill_everything(proc: subprocess.Popen[bytes], sandbox_uid: int | None) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if sandbox_uid is not None and (not os.path.isdir("/proc") or any(
            state != "Z" for _, state, _ in _tasks_of_uid(sandbox_uid))):
        # kill(-1) sent as the uid reaches every process of it (but the sender) atomically, fork bombs included
        subprocess.run([sys.executable, "-I", "-S", "-c", _KILL_ALL_OF_UID, str(sandbox_uid)],
                       env={"PATH": _SEARCH_PATH}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False, timeout=_REAP_DEADLINE_S)


def _await_uid_gone(uid: int) -> None:
    """Kill and wait until no live (non-zombie) process runs as ``uid``, for at most a few seconds."""
    deadline = time.monotonic() + _REAP_DEADLINE_S
    while (survivors := [pid for pid, state, _ in _tasks_of_uid(uid) if state != "Z"]):
        if time.monotonic() > deadline:
            logger.error("sandbox uid %d still has processes %s after SIGKILL", uid, survivors)
            return
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _tasks_of_uid(uid: int) -> list[tuple[int, str, int]]:
    """(pid, state letter, thread count) of every process whose real uid is ``uid``, from /proc."""
    found: list[tuple[int, str, int]] = []
    if not os.path.isdir("/proc"):
        return found
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in Path(entry.path, "status").read_text().splitlines()
                          if ":" in line)
        except OSError:  # exited while we looked
            continue
        if int(fields["Uid"].split()[0]) == uid:
            found.append((int(entry.name), fields["State"].split()[0], int(fields.get("Threads", "1"))))
    return found


def _allocate_uid() -> int:
    """A uid (also used as gid) that no account, group or running process uses."""
    rng = random.SystemRandom()
    for _ in range(100):
        uid = rng.randrange(*_UID_RANGE)
        if _unknown(pwd.getpwuid, uid) and _unknown(grp.getgrgid, uid) and not _tasks_of_uid(uid):
            return uid
    raise RuntimeError(f"found no free uid in {_UID_RANGE}; processes of earlier sandboxes may be alive")


def _unknown(lookup: Any, number: int) -> bool:
    try:
        lookup(number)
    except KeyError:
        return True
    return False


def _nproc_limit(max_processes: int, sandbox_uid: int | None) -> int | None:
    """RLIMIT_NPROC to set: per-run uids start at zero tasks; a shared uid adds its current tasks."""
    if sandbox_uid is not None:
        return max_processes
    if not os.path.isdir("/proc"):
        return None
    return max_processes + sum(threads for _, _, threads in _tasks_of_uid(os.getuid()))


def _classify(stop_reason: str | None, returncode: int | None, stderr: str) -> SandboxStatus:
    if stop_reason == "output_limit":
        return "output_limit"
    if stop_reason == "timeout" or returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode == _SETUP_EXIT_CODE and stderr.startswith(_SETUP_MARKER):
        return "error"
    if returncode == 0:
        return "passed"
    return "killed" if returncode is not None and returncode < 0 else "failed"


def _remove_tree(path: Path) -> None:
    """Delete the sandbox dir even if the program made parts of it unreadable (matters when not root)."""
    try:
        shutil.rmtree(path)
        return
    except OSError:
        pass
    os.chmod(path, 0o700)
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            child = os.path.join(root, name)
            if not os.path.islink(child):
                os.chmod(child, 0o700)
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        logger.warning("could not remove sandbox directory %s; delete it by hand", path)


# --- child side: runs as `python -I -S sandbox.py CONFIG` in the new session, then execs the program ---


def _child_main(config: dict[str, Any]) -> None:
    """Enter namespaces, set limits, drop privileges and exec the program; exit 125 with a marker on failure."""
    try:
        os.umask(0o022)
        # The base interpreter, resolved before the mounts: a venv's python may live under /tmp,
        # which the mount namespace replaces by the sandbox dir (the program needs the stdlib only).
        interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
        home, network_isolated = _enter_namespaces(config)
        _apply_limits(config)
        if config["uid"] is not None:
            os.setgroups([])
            os.setgid(config["uid"])
            os.setuid(config["uid"])
        libc = _load_libc()
        if libc is not None:
            libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if not os.access(interpreter, os.X_OK):
            raise PermissionError(f"the sandbox user cannot execute {interpreter}; install Python where "
                                  "every user can read it, or allow mount namespaces")
        argv = [interpreter, "-I"]
        if not config["network"] and not network_isolated:
            argv += ["-c", _NETWORK_GUARD]
        env = {"PATH": _SEARCH_PATH, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        os.execve(interpreter, [*argv, _PROGRAM_NAME], env)
    except Exception as exc:  # noqa: BLE001 - anything here is a sandbox failure, reported as status "error"
        os.write(2, f"{_SETUP_MARKER} {type(exc).__name__}: {exc}\n".encode())
        os._exit(_SETUP_EXIT_CODE)


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _enter_namespaces(config: dict[str, Any]) -> tuple[str, bool]:
    """Mount namespace (root only) and network namespace; returns (sandbox home, network isolated?)."""
    libc = _load_libc()
    home = os.getcwd()
    if libc is None:
        return home, False
    if config["uid"] is not None and libc.unshare(_CLONE_NEWNS) == 0:
        _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
        _expose_interpreter(libc)
        _cap_directory(libc, config["total_bytes"], config["uid"])
        home = _redirect_shared_tmp(libc)
    network_isolated = not config["network"] and libc.unshare(_CLONE_NEWNET) == 0
    return home, network_isolated


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    encode = (lambda text: None if text is None else text.encode())
    if libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount({source!r} -> {target!r}) failed: {os.strerror(errno)}")


def _expose_interpreter(libc: ctypes.CDLL) -> None:
    """Make the interpreter reachable for the sandbox uid when it lives below a directory others cannot enter."""
    roots = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(
        sys.executable)))}
    roots = {r for r in roots if not any(r.startswith(other + os.sep) for other in roots)}
    by_blocker: dict[str, list[str]] = {}
    for root in sorted(roots):
        parts = Path(root).parts
        ancestors = [str(Path(*parts[:depth])) for depth in range(2, len(parts))]
        blocker = next((a for a in ancestors if not os.stat(a).st_mode & stat.S_IXOTH), None)
        if blocker is not None:
            by_blocker.setdefault(blocker, []).append(root)
    for blocker, hidden_roots in by_blocker.items():
        stages = [os.path.abspath(f".expose-{index}") for index in range(len(hidden_roots))]
        for stage, root in zip(stages, hidden_roots):
            os.mkdir(stage, 0o700)
            _mount(libc, root, stage, None, _MS_BIND | _MS_REC)
        _mount(libc, "tmpfs", blocker, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
        for stage, root in zip(stages, hidden_roots):
            os.makedirs(root, mode=0o755, exist_ok=True)
            _mount(libc, stage, root, None, _MS_MOVE)
            os.rmdir(stage)


def _cap_directory(libc: ctypes.CDLL, total_bytes: int, uid: int) -> None:
    """Replace the sandbox directory (the cwd) by a tmpfs of ``total_bytes`` holding only the program."""
    program = Path(_PROGRAM_NAME).read_bytes()
    here = os.getcwd()
    _mount(libc, "tmpfs", here, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={total_bytes},nr_inodes={_MAX_INODES},mode=0700,uid={uid},gid={uid}")
    os.chdir(here)  # the cwd still named the directory under the mount
    Path(_PROGRAM_NAME).write_bytes(program)
    os.chown(_PROGRAM_NAME, uid, uid)


def _redirect_shared_tmp(libc: ctypes.CDLL) -> str:
    """Bind the sandbox dir over the world-writable scratch dirs; return the path the program should use."""
    sandbox_dir = os.open(".", os.O_PATH | os.O_DIRECTORY)
    bound = []
    try:
        for target in _SHARED_TMP_DIRS:
            try:
                mode = os.stat(target).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(mode) and mode & stat.S_IWOTH:
                _mount(libc, f"/proc/self/fd/{sandbox_dir}", target, None, _MS_BIND)
                bound.append(target)
    finally:
        os.close(sandbox_dir)
    if "/tmp" in bound:
        os.chdir("/tmp")
    return os.getcwd()


def _apply_limits(config: dict[str, Any]) -> None:
    limits = [
        (resource.RLIMIT_AS, config["memory_bytes"], config["memory_bytes"]),
        (resource.RLIMIT_CPU, config["cpu_s"], config["cpu_s"] + 1),  # SIGXCPU first, SIGKILL a second later
        (resource.RLIMIT_FSIZE, config["file_bytes"], config["file_bytes"]),
        (resource.RLIMIT_NOFILE, _MAX_OPEN_FILES, _MAX_OPEN_FILES),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if config["nproc"] is not None:
        limits.append((resource.RLIMIT_NPROC, config["nproc"], config["nproc"]))
    for limit, soft, hard in limits:
        _, current_hard = resource.getrlimit(limit)
        if current_hard != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(limit, (soft, hard))


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
