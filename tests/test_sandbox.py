"""Hostile programs against harness.sandbox: each must end fast, not pass, and leave the host untouched.

Leftover processes are found by scanning /proc here (independently of the module's own bookkeeping).
Tests marked ``requires_root`` check the privilege drop and the namespaces, which only root can set up.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from harness import sandbox
from harness.sandbox import SandboxResult, check_program, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inspects /proc; Linux only")
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop and namespaces need root")

FAST = {"timeout_s": 3.0}


def _live_processes(*, uid: int | None = None, pgid: int | None = None) -> list[int]:
    """Pids of non-zombie processes owned by ``uid`` or in process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            owner = entry.stat().st_uid
            # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may contain spaces, so split after ')'.
            state, _ppid, group = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if state != "Z" and ((uid is not None and owner == uid) or (pgid is not None and int(group) == pgid)):
            found.append(int(entry.name))
    return found


def _run(program: str, **limits: object) -> SandboxResult:
    return run_python(textwrap.dedent(program), **{**FAST, **limits})


def test_passing_program_passes() -> None:
    result = _run("""
        def add(a, b):
            return a + b
        assert add(2, 3) == 5
        assert __name__ == "__main__"
        print("ok")
    """)
    assert (result.passed, result.status, result.returncode) == (True, "passed", 0)
    assert result.stdout == "ok\n"
    assert check_program("pass", **FAST) is True


def test_failing_assert_fails() -> None:
    result = _run("assert 1 + 1 == 3, 'arithmetic is broken'")
    assert (result.passed, result.status, result.returncode) == (False, "failed", 1)
    assert "AssertionError: arithmetic is broken" in result.stderr
    assert check_program("raise SystemExit(3)", **FAST) is False


@pytest.mark.slow
def test_infinite_loop_times_out_and_its_group_dies() -> None:
    result = _run("""
        import os
        print(os.getpid(), flush=True)
        while True:
            pass
    """, timeout_s=2.0)
    assert (result.passed, result.status) == (False, "timeout")
    assert 2.0 <= result.duration_s < 4.0
    leader = int(result.stdout.split()[0])
    assert _live_processes(pgid=leader) == []


@pytest.mark.slow
def test_fork_bomb_is_bounded_and_leaves_nothing_behind() -> None:
    result = _run("""
        import os, time
        print(os.getuid(), os.getpgid(0), flush=True)
        children = 0
        while True:  # first count how far fork gets, keeping every child alive
            try:
                pid = os.fork()
            except OSError as error:
                print(children, error.errno, flush=True)
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children += 1
        while True:  # then bomb for real: every process forks forever
            try:
                os.fork()
            except OSError:
                pass
    """, max_processes=16)
    assert not result.passed and result.status == "timeout"
    (uid, pgid), (children, fork_errno) = (map(int, line.split()) for line in result.stdout.splitlines()[:2])
    assert fork_errno == errno.EAGAIN
    assert 1 <= children < 16
    assert _live_processes(pgid=pgid) == []
    if os.geteuid() == 0:
        assert uid != 0 and _live_processes(uid=uid) == []


def test_huge_allocation_is_refused() -> None:
    result = _run("blob = bytearray(50 * 2**30)")
    assert (result.passed, result.status) == (False, "failed")
    assert "MemoryError" in result.stderr
    assert _run("blob = bytearray(100 * 2**20); print(len(blob))", memory_mb=512).stdout == f"{100 * 2**20}\n"


_DELETE_ATTEMPTS = """
    import json, os, shutil
    target, folder = {target!r}, {folder!r}
    outcomes = {{"visible": os.path.exists(target)}}
    attempts = {{
        "remove": lambda: os.remove(target),
        "rmtree": lambda: shutil.rmtree(folder),
        "overwrite": lambda: open(target, "w").write("pwned"),
        "chmod": lambda: os.chmod(target, 0o777),
        "rename": lambda: os.rename(target, target + ".moved"),
    }}
    for name, attempt in attempts.items():
        try:
            attempt()
            outcomes[name] = "succeeded"
        except OSError as error:
            outcomes[name] = type(error).__name__
    print(json.dumps(outcomes))
"""


def _protected_victim(folder: Path) -> Path:
    folder.chmod(0o755)  # others may look, only the owner (root) may change entries
    victim = folder / "victim.txt"
    victim.write_text("keep me")
    victim.chmod(0o644)
    return victim


def _assert_untouched(victim: Path, outcomes: dict[str, object]) -> None:
    assert victim.read_text() == "keep me"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not victim.with_name("victim.txt.moved").exists()
    assert "succeeded" not in outcomes.values(), outcomes


def test_cannot_delete_a_file_in_the_tests_tmp_path(tmp_path: Path) -> None:
    folder = tmp_path / "protected"
    folder.mkdir()
    victim = _protected_victim(folder)
    result = _run(_DELETE_ATTEMPTS.format(target=str(victim), folder=str(folder)))
    _assert_untouched(victim, json.loads(result.stdout))


@requires_root
def test_cannot_delete_a_root_file_it_can_see() -> None:
    # Outside /tmp, which the sandbox does not see at all, so the attempt meets file permissions alone.
    parent = next((p for p in map(Path, ("/run", "/var/lib", "/opt", "/srv"))
                   if p.is_dir() and p.stat().st_mode & stat.S_IXOTH and not p.stat().st_mode & stat.S_IWOTH), None)
    if parent is None:
        pytest.skip("no root-owned, world-traversable directory to plant the victim in")
    folder = Path(tempfile.mkdtemp(prefix="sandbox-victim-", dir=parent))
    try:
        victim = _protected_victim(folder)
        result = _run(_DELETE_ATTEMPTS.format(target=str(victim), folder=str(folder)))
        outcomes = json.loads(result.stdout)
        assert outcomes["visible"] is True
        assert outcomes["remove"] == "PermissionError"
        _assert_untouched(victim, outcomes)
    finally:
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()


_CONNECT = """
    import socket
    with socket.create_connection(("127.0.0.1", {port}), timeout=2) as connection:
        connection.sendall(b"pwned")
    print("connected")
"""


@pytest.mark.parametrize("network", [False, True], ids=["isolated", "control-network-allowed"])
def test_socket_to_host_listener(network: bool) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        result = _run(_CONNECT.format(port=server.getsockname()[1]), network=network)
        if network:  # proves the listener is reachable, so the isolated case can fail
            assert result.passed, result.stderr
            connection, _ = server.accept()
            assert connection.recv(16) == b"pwned"
            connection.close()
            return
        assert (result.passed, result.status) == (False, "failed")
        assert "connected" not in result.stdout
        with pytest.raises(socket.timeout):
            server.accept()


@requires_root
def test_network_namespace_holds_only_a_loopback() -> None:
    result = _run("print(open('/proc/net/dev').read())")
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"]


def test_network_guard_fallback_refuses_inet_sockets(tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text(textwrap.dedent("""
        import socket
        left, right = socket.socketpair()  # AF_UNIX stays allowed
        try:
            socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except PermissionError as error:
            print("refused:", error)
    """))
    completed = subprocess.run([sys.executable, "-I", "-c", sandbox._NETWORK_GUARD, "main.py"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=30, check=True)
    assert completed.stdout == "refused: network access is disabled in this sandbox\n"


def test_output_flood_is_cut_at_the_cap() -> None:
    result = _run("while True: print('x' * 10000)", max_output_bytes=20_000)
    assert (result.passed, result.status) == (False, "output_limit")
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= 20_000
    assert result.stdout.startswith("x" * 10_000)
    assert result.duration_s < 2.5


def test_huge_file_is_stopped_by_the_file_size_limit() -> None:
    result = _run("""
        import os
        try:
            with open("big.bin", "wb") as sink:
                while True:
                    sink.write(bytes(2**20))
        except OSError as error:
            print(error.errno, os.path.getsize("big.bin"))
            raise
    """, max_file_bytes=4 * 2**20)
    assert (result.passed, result.status) == (False, "failed")
    error_number, size = map(int, result.stdout.split())
    assert error_number == errno.EFBIG
    assert size <= 4 * 2**20


@requires_root
def test_background_process_that_left_the_group_is_killed() -> None:
    result = _run("""
        import os, time
        child = os.fork()
        if child == 0:
            os.setsid()  # leaves the process group, so a group kill alone would miss it
            time.sleep(60)
            os._exit(0)
        print(os.getuid(), child, flush=True)
    """)
    assert result.passed, result.stderr
    uid, child = map(int, result.stdout.split())
    assert _live_processes(uid=uid) == []


@requires_root
def test_runs_unprivileged_and_leaves_nothing_in_shared_tmp() -> None:
    name = f"sandbox-leak-{uuid.uuid4().hex}"
    result = _run(f"""
        import os
        print(os.getuid(), os.geteuid(), os.getgroups())
        for folder in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.isdir(folder):
                open(os.path.join(folder, {name!r}), "w").write("left behind")
        try:
            os.setuid(0)
            print("became root")
        except PermissionError:
            print("still unprivileged")
    """)
    assert result.passed, result.stderr
    ids, verdict = result.stdout.splitlines()
    uid, euid, groups = ids.split(" ", 2)
    assert int(uid) != 0 and int(euid) != 0 and groups == "[]"
    assert verdict == "still unprivileged"
    assert not any((Path(folder) / name).exists() for folder in ("/tmp", "/var/tmp", "/dev/shm"))


def test_environment_is_minimal_and_workdir_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    sandboxes, outside = tmp_path / "sandboxes", tmp_path / "outside"
    sandboxes.mkdir()
    outside.mkdir()
    (outside / "keep.txt").write_text("keep me")
    monkeypatch.setattr(tempfile, "tempdir", str(sandboxes))
    result = _run(f"""
        import json, os, sys
        os.makedirs("nested/deeper")
        open("nested/deeper/file.txt", "w").write("data")
        os.chmod("nested", 0)
        os.symlink({str(outside)!r}, "link-to-outside")  # cleanup must remove the link, not follow it
        print(json.dumps({{"env": dict(os.environ), "cwd": os.getcwd(), "isolated": sys.flags.isolated}}))
    """)
    assert result.passed, result.stderr
    report = json.loads(result.stdout)
    assert "hunter2" not in result.stdout
    assert set(report["env"]) == {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL"}
    assert report["env"]["HOME"] == report["env"]["TMPDIR"] == report["cwd"]
    assert report["isolated"] == 1
    assert list(sandboxes.iterdir()) == []
    assert (outside / "keep.txt").read_text() == "keep me"


@pytest.mark.slow
def test_cpu_limit_counts_as_timeout_and_signal_death_as_killed() -> None:
    spinning = _run("while True: pass", timeout_s=5.0, cpu_s=1)
    assert (spinning.status, spinning.returncode) == ("timeout", -signal.SIGXCPU)
    assert spinning.duration_s < 4.0
    suicide = _run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert (suicide.passed, suicide.status, suicide.returncode) == (False, "killed", -signal.SIGSEGV)


def test_unstartable_interpreter_is_an_error_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    result = _run("pass")
    assert (result.passed, result.status, result.returncode) == (False, "error", None)
    assert "/nonexistent/python3" in result.stderr


@pytest.mark.parametrize("limits, named", [
    ({"timeout_s": 0}, "timeout_s=0"),
    ({"memory_mb": 8}, "memory_mb=8"),
    ({"max_processes": 0}, "max_processes=0"),
    ({"cpu_s": 0}, "cpu_s=0"),
])
def test_invalid_limits_name_the_bad_value(limits: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        run_python("pass", **limits)


_WRITE_MANY = textwrap.dedent("""
    import os
    written = 0
    try:
        for index in range({files}):
            for where in ("f{{}}.bin", "/tmp/t{{}}.bin"):
                with open(where.format(index), "wb") as handle:
                    handle.write(b"x" * {size})
                written += {size}
    except OSError as exc:
        print("stopped after", written, "bytes:", exc.strerror)
        raise SystemExit(3)
    print("wrote", written)
""")


@requires_root
def test_total_writes_are_capped_not_only_each_file() -> None:
    """Many files each under the per-file cap (8 MB < 16 MB) stop at the total cap, /tmp included."""
    result = run_python(_WRITE_MANY.format(files=20, size=8 * 2**20), max_total_bytes=40 * 2**20,
                        memory_mb=256, timeout_s=30)
    assert result.status == "failed" and result.returncode == 3, result
    assert "No space left on device" in result.stdout
    stopped = int(result.stdout.split("stopped after ")[1].split()[0])
    assert 24 * 2**20 <= stopped <= 40 * 2**20  # everything up to the cap was written, nothing past it


@requires_root
def test_writes_under_the_total_cap_succeed_and_vanish(tmp_path: Path) -> None:
    result = run_python(_WRITE_MANY.format(files=2, size=2**20), max_total_bytes=8 * 2**20, timeout_s=30)
    assert result.passed and result.stdout.strip() == f"wrote {4 * 2**20}", result
    assert not any(Path("/tmp").glob("t0.bin"))  # /tmp writes landed in the sandbox's tmpfs


@requires_root
def test_many_tiny_files_are_capped_by_the_inode_limit() -> None:
    program = textwrap.dedent("""
        count = 0
        try:
            while True:
                open(f"f{count}", "w").close()
                count += 1
        except OSError as exc:
            print(count, exc.strerror)
    """)
    result = run_python(program, timeout_s=30)
    assert result.passed, result
    count = int(result.stdout.split()[0])
    assert count < sandbox._MAX_INODES and "No space left on device" in result.stdout


def test_total_cap_below_one_mebibyte_is_refused() -> None:
    with pytest.raises(ValueError, match="max_total_bytes"):
        run_python("pass", max_total_bytes=1000)


def _mutants(source: str, count: int, seed: int = 0) -> list[str]:
    """``source`` with one random character deleted, inserted or replaced (most no longer compile)."""
    import random

    rng = random.Random(seed)
    alphabet = "():[]{}'\"\\#:=,.\n\t @*-+0aZ\u00e9\u20ac\x00"
    out = []
    for _ in range(count):
        at = rng.randrange(len(source))
        edit = rng.choice(("delete", "insert", "replace"))
        char = rng.choice(alphabet)
        out.append(source[:at] + ("" if edit == "delete" else char) + source[at + (edit != "insert"):])
    return out


SYNTAX_CASES = [
    "def f(:\n    return 1\n",
    "def f():\nreturn 1\n",  # no indent
    "if True:\n\tx = 1\n        y = 2\n",  # tabs and spaces
    "s = 'unterminated\n",
    'f"{"\n',
    "x = 1\0\n",
    "# -*- coding: latin-1 -*-\ns = 'caf\u00e9'\nassert len(s) == 5\n",  # compiles; the cookie makes it 5 chars
    "# -*- coding: no-such-codec -*-\nx = 1\n",
    "\ufeffx = 1\nassert x == 1\n",  # a BOM
    "from __future__ import braces\n",
    "def g():\n    yield = 3\n",
    "x = 1\nassert x == 2\n",  # compiles, fails when run
    "import sys\nsys.exit(0)\n",
]


@pytest.mark.slow
def test_a_program_that_does_not_compile_fails_here_as_it_would_in_the_sandbox(monkeypatch) -> None:
    """The syntax check in the caller's process gives the sandbox's own verdict, without starting it.

    Each program runs through the sandbox with the check switched off (the interpreter there
    compiles the file itself) and through ``run_python``; a program the check refuses must start
    no process at all."""
    body = "def add(a, b):\n    \"\"\"Sum.\"\"\"\n    return a + b\n\nassert add(2, 3) == 5\n"
    programs = SYNTAX_CASES + _mutants(body, 40)
    refused = 0
    for program in programs:
        with monkeypatch.context() as patch:
            patch.setattr(sandbox, "syntax_error", lambda _: None)
            real = _run(program)
        error = sandbox.syntax_error(program)
        if error is None:
            continue
        refused += 1
        with monkeypatch.context() as patch:
            patch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"a process for {program!r}"))
            quick = _run(program)
        assert (quick.passed, quick.status, quick.returncode) == (real.passed, real.status, real.returncode) \
            == (False, "failed", 1), (program, real.stderr)
        kind = error.strip().splitlines()[-1].split(":")[0]  # SyntaxError, IndentationError, TabError
        assert kind in real.stderr, (program, error, real.stderr)
    assert refused >= 25 and refused < len(programs)  # most mutants and cases are refused; the rest ran
