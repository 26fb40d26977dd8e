"""A command run in a real terminal (tmux), its screen and its raw output read back.

tmux is a terminal emulator: what ``capture-pane`` returns is what a person would see in a
window of that size (the scrollback included), after every carriage return, cursor move and
line erase has been applied. ``pipe-pane`` records the raw bytes the program wrote, so a test
can also tell a display redrawn in place from one that prints a new line for every update.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Capture:
    screen: str  # the scrollback and the visible screen, trailing blank lines dropped
    raw: bytes  # every byte the command wrote to the terminal
    status: int  # the command's exit status


def require_tmux() -> str:
    """tmux's path; skips the test without it unless HARNESS_REQUIRE_SYSTEM_TESTS=1 (then it fails)."""
    path = shutil.which("tmux")
    if path:
        return path
    if os.environ.get("HARNESS_REQUIRE_SYSTEM_TESTS") == "1":
        pytest.fail("tmux is not installed but HARNESS_REQUIRE_SYSTEM_TESTS=1; run scripts/system_deps.sh as root")
    pytest.skip("tmux not installed (scripts/system_deps.sh installs it); HARNESS_REQUIRE_SYSTEM_TESTS=1 fails")


def run_in_terminal(command: str, workdir: Path, *, env: dict[str, str] | None = None, width: int = 120,
                    height: int = 40, timeout_s: float = 900.0) -> Capture:
    """Run ``command`` (a shell line) in a detached tmux window of ``width`` x ``height``; wait for it."""
    tmux = shutil.which("tmux") or "tmux"
    workdir.mkdir(parents=True, exist_ok=True)
    session = f"harness-{uuid.uuid4().hex[:8]}"
    socket = Path("/tmp") / f"{session}.sock"  # a private server (short path: sockets cap it at 107 bytes)
    raw_path, status_path = workdir / "terminal.raw", workdir / "terminal.status"
    script = workdir / "terminal.sh"  # typed as one short line; the command itself never wraps on screen
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
    script.write_text(f"{exports}{command}\necho $? > {shlex.quote(str(status_path))}\n")
    base = [tmux, "-S", str(socket), "-f", os.devnull]
    subprocess.run([*base, "new-session", "-d", "-s", session, "-x", str(width), "-y", str(height), "-c",
                    str(workdir), "env PS1= bash --noprofile --norc"], check=True)
    try:
        subprocess.run([*base, "set-option", "-t", session, "history-limit", "50000"], check=True)
        subprocess.run([*base, "pipe-pane", "-t", session, "-o", f"cat >> {shlex.quote(str(raw_path))}"],
                       check=True)
        subprocess.run([*base, "send-keys", "-t", session, f"clear; bash {shlex.quote(str(script))}",
                        "Enter"], check=True)
        deadline = time.monotonic() + timeout_s
        while not status_path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{command!r} did not finish in {timeout_s:.0f} s in the terminal")
            time.sleep(0.5)
        time.sleep(0.5)  # the pipe flushes the last bytes
        screen = subprocess.run([*base, "capture-pane", "-p", "-t", session, "-S", "-", "-E", "-"], check=True,
                                capture_output=True, text=True).stdout
    finally:
        subprocess.run([*base, "kill-server"], check=False, capture_output=True)
        socket.unlink(missing_ok=True)
    lines = screen.rstrip("\n").splitlines()
    start = next((i for i, text in enumerate(lines) if str(script) in text), -1) + 1  # after the typed line
    shown = "\n".join(text.rstrip() for text in lines[start:]).rstrip() + "\n"
    return Capture(shown, raw_path.read_bytes() if raw_path.exists() else b"", int(status_path.read_text()))
