"""The ``vllm-serve`` engine: a server the harness starts from ``candidate.serve`` and stops at the end.

``candidate.serve="vllm serve <export> --host 127.0.0.1 --port {port}"`` (or any command that serves
the OpenAI completions API) is started on a free loopback port (:class:`ServedProcess`; its log in the
results directory as ``serve.log``), waited for until healthy, and then answered through exactly as
the ``openai`` engine answers a running server (:mod:`harness.engines.openai_endpoint`). vLLM returns at
most 20 log-probs per position unless its command raises ``--max-logprobs``.
"""
from __future__ import annotations

import atexit
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from harness.config import CandidateConfig
from harness.engines.base import Capabilities
from harness.engines.openai_endpoint import OpenAIEndpoint
from harness.engines.openai_http import EndpointError, healthy, scrub
from harness.engines.registry import register_engine

log = logging.getLogger(__name__)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks it; the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServedProcess:
    """``candidate.serve``: a server command started on a loopback port, its log kept in a file.

    ``command`` holds ``{port}``; it is split like a shell line (no shell runs it, so nothing in it is
    expanded). The process gets its own process group, stopped with SIGTERM then SIGKILL.
    """

    def __init__(self, command: str, log_path: Path, *, startup_timeout_s: float = 600.0,
                 secret_env: str | None = None, env: dict[str, str] | None = None, role: str = "candidate"):
        self.role = role  # the side it serves, as messages name its setting: <role>.serve
        if "{port}" not in command:
            raise EndpointError(f"{role}.serve={command!r} has no {{port}}: the harness picks a free loopback "
                                "port and puts it there, e.g. 'vllm serve <dir> --host 127.0.0.1 --port {port}'")
        self.port = free_port()
        self.argv = shlex.split(command.replace("{port}", str(self.port)))
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.secret_env = secret_env
        self.env = {**os.environ, **(env or {})}  # the server inherits the job's environment (and its key)
        self.process: subprocess.Popen | None = None
        self.group_gone = False  # stop() saw none of the server's process group left

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, lines: int = 5) -> str:
        """The last non-empty lines of the server's log, joined into one line (any key redacted)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
        return scrub(" | ".join(kept) or "(empty log)", self.secret_env)

    def exit_line(self) -> str | None:
        """None while the server runs; else how it ended, with its last log lines."""
        if self.process is None or self.process.poll() is None:
            return None
        return f"the server (pid {self.process.pid}) exited with code {self.process.returncode}; last log lines: " \
               f"{self.tail()}"

    def start(self) -> "ServedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(self.argv, stdout=handle, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise EndpointError(f"cannot start {self.role}.serve ({self.argv[0]}: {exc.strerror}); check the "
                                "command's first word is an executable (e.g. .venv-engine/bin/vllm)") from None
        finally:
            handle.close()
        atexit.register(self.stop)  # a job that dies of anything else still stops the server it started
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            ended = self.exit_line()
            if ended:
                raise EndpointError(f"{self.role}.serve did not come up: {ended}")
            if healthy(self.url):
                log.info("%s server up on %s (pid %d, log %s)", self.role, self.url, self.process.pid, self.log_path)
                return self
            time.sleep(1.0)
        self.stop()
        raise EndpointError(f"{self.role}.serve was not healthy after {self.startup_timeout_s:.0f} s; last log lines: "
                            f"{self.tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to the server's whole process group, until none of it is left: a server that
        exited (or was killed) alone leaves its children behind (vLLM's engine core and workers, GBs of memory)."""
        if self.process is None or self.group_gone:  # once gone, its number may be another group's
            return
        group = self.process.pid  # start_new_session: the server leads its own process group
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                self.group_gone = True
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.process.poll()  # reap the leader, so that only live members keep the group
                try:
                    os.killpg(group, 0)
                except ProcessLookupError:
                    self.group_gone = True
                    return
                time.sleep(0.1)

    def __enter__(self) -> "ServedProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class VLLMServe(OpenAIEndpoint):
    """``candidate.serve``: vLLM's server (or any OpenAI-compatible one) started by the harness (see the module)."""

    capabilities = Capabilities(generate=True, loglikelihood=True, prompt_logprobs=True, top_k=20, starts_server=True)

    def __init__(self, cfg: CandidateConfig, results_dir: Path) -> None:
        super().__init__(cfg, results_dir)
        self.process = ServedProcess(str(cfg.serve), self.results_dir / "serve.log",
                                     startup_timeout_s=cfg.serve_startup_s, secret_env=cfg.endpoint_api_key_env)

    @classmethod
    def serves(cls, cfg: CandidateConfig) -> bool:
        return bool(cfg.serve)

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def server(self) -> ServedProcess:
        return self.process

    def start(self) -> VLLMServe:
        """Start the server, wait until it is healthy, then connect (stopping it again when that fails)."""
        self.process.role = self.role
        self.process.start()
        try:
            super().start()
        except BaseException:
            self.process.stop()
            raise
        return self

    def stop(self) -> None:
        self.process.stop()


register_engine("vllm-serve", VLLMServe)
