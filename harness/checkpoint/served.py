"""A served candidate in the job: the artifact that ships, judged on the engine that serves it.

``quant=external candidate.endpoint=http://host:8000`` evaluates whatever an OpenAI-compatible server
serves; ``quant=external candidate.serve="vllm serve <export> --host 127.0.0.1 --port {port}"`` starts
that server first (a free loopback port, its log in the results directory as ``serve.log``) and stops it
after the evaluation. The items are answered by :mod:`harness.evaluation.endpoint` with the prompts of
the reference's own lm-eval wrapper, so the per-item records pair with the reference's exactly as a
simulated candidate's do: flips, the score test, the gate and sequential evaluation are unchanged.

Token divergence (:meth:`ServedCandidate.divergence`): each of the reference's divergence texts (the
prompt as evaluated + the reference's own reply) is sent to the server as token ids with ``echo=true,
max_tokens=0, logprobs=k`` (``candidate.endpoint_divergence_topk``); NLL and top-1 agreement are exact,
and the KL is KL on the server's top-k partition, a lower bound of the exact KL
(:mod:`harness.divergence.topk_bound`), labelled so in every row, the summary and the tables. A server
that returns no log-probs gives accuracy and flips only, and the run says so in one line.

What a served candidate does not give: a per-layer weight report (its weights are in the server, not
in this process); the run's notes say so. When the server names a local
checkpoint directory (vLLM's ``/v1/models`` ``root``), its scheme and *stored* bits per weight are read
from that directory's config and safetensors headers (:func:`harness.checkpoint.candidate.describe`).

Secrets: the API key is read from the environment variable ``candidate.endpoint_api_key_env`` names,
at each request, into the ``Authorization`` header only. A URL with credentials in it and a serve
command with ``--api-key`` are refused before any work: the config is logged (MLflow params, job log).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pandas as pd

from harness.checkpoint.served_config import check_config, served_name
from harness.config import CandidateConfig
from harness.divergence import topk_bound as served_divergence
from harness.divergence.scoring import ReferenceText
from harness.evaluation.endpoint import EndpointError, EndpointSpec, endpoint_lm, redact_url, scrub, teacher_forced

__all__ = ["NOT_MEASURED", "ServedCandidate", "ServedProcess", "check_config", "free_port", "served_name"]

log = logging.getLogger(__name__)

NOT_MEASURED = ("served candidate: answered over HTTP; its weights stay in the server (no per-layer weight "
                "report), and its KL, where the server returns prompt log-probs, is a lower bound from their top-k")


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
                 secret_env: str | None = None, env: dict[str, str] | None = None):
        if "{port}" not in command:
            raise EndpointError(f"candidate.serve={command!r} has no {{port}}: the harness picks a free loopback "
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
            raise EndpointError(f"cannot start candidate.serve ({self.argv[0]}: {exc.strerror}); check the "
                                "command's first word is an executable (e.g. .venv-engine/bin/vllm)") from None
        finally:
            handle.close()
        atexit.register(self.stop)  # a job that dies of anything else still stops the server it started
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            ended = self.exit_line()
            if ended:
                raise EndpointError(f"candidate.serve did not come up: {ended}")
            if _healthy(self.url):
                log.info("candidate server up on %s (pid %d, log %s)", self.url, self.process.pid, self.log_path)
                return self
            time.sleep(1.0)
        self.stop()
        raise EndpointError(f"candidate.serve was not healthy after {self.startup_timeout_s:.0f} s; last log lines: "
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


def _healthy(url: str) -> bool:
    for path in ("/health", "/v1/models"):
        try:
            with urllib.request.urlopen(url + path, timeout=5) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            continue
    return False


class ServedCandidate:
    """The job's served candidate: its server (when the harness starts it) and its lm-eval model."""

    def __init__(self, cfg: CandidateConfig, results_dir: Path):
        self.cfg = cfg
        self.server = (ServedProcess(cfg.serve, Path(results_dir) / "serve.log", startup_timeout_s=cfg.serve_startup_s,
                                     secret_env=cfg.endpoint_api_key_env) if cfg.serve else None)
        self._lm: Any = None
        self.params: dict[str, Any] = {"candidate.name": served_name(cfg), "candidate.method": "served",
                                       "candidate.endpoint": redact_url(cfg.endpoint) if cfg.endpoint else "serve"}

    @property
    def url(self) -> str:
        return self.server.url if self.server is not None else str(self.cfg.endpoint)

    def start(self) -> "ServedCandidate":
        if self.server is not None:
            self.server.start()
        return self

    def stop(self) -> None:
        """Stop the server the harness started; the endpoint's request counts land in the run's parameters."""
        if self._lm is not None:
            lm = self._lm
            self.params.update({"candidate.endpoint_requests": lm.client.requests,
                                "candidate.endpoint_prompt_tokens": lm.prompt_tokens,
                                "candidate.endpoint_generated_tokens": lm.generated_tokens,
                                "candidate.endpoint_seconds": round(lm.seconds, 3)})
        if self.server is not None:
            self.server.stop()

    def lm(self, twin: Any) -> Any:
        """The endpoint's lm-eval model (created once: its tokenizer probe runs once per job)."""
        if self._lm is None:
            spec = EndpointSpec(url=self.url, model=self.cfg.endpoint_model, api_key_env=self.cfg.endpoint_api_key_env,
                                timeout_s=self.cfg.endpoint_timeout_s, batch_size=self.cfg.endpoint_batch_size,
                                concurrency=self.cfg.endpoint_concurrency)
            self._lm = endpoint_lm(spec, twin, self.server)
            self.params["candidate.served_model"] = self._lm.client.model
            if self._lm.server_max_len:
                self.params["candidate.max_model_len"] = self._lm.server_max_len
            if getattr(twin, "model", None) is not None:
                self.describe(twin.model)
        return self._lm

    def divergence(self, texts: dict[str, list[ReferenceText]]) -> pd.DataFrame:
        """Token rows of the served candidate on each slice's divergence texts (``texts``: slice -> the
        reference's texts), from the server's teacher-forced top-k log-probs: KL as a top-k lower bound.

        Says what was measured in one line (``candidate.divergence`` in the run's summary, and the log);
        a server without log-probs gives no rows, and that line says accuracy and flips only.
        """
        k = int(self.cfg.endpoint_divergence_topk)
        if self._lm is None or k == 0:
            why = "candidate.endpoint_divergence_topk=0" if k == 0 else "the endpoint answered no items"
            return self._no_divergence(why)
        lm = self._lm
        limit = lm.server_max_len
        start = time.perf_counter()
        frames, skipped = [], 0
        try:
            for slice_name, references in texts.items():
                kept = [(index, ref) for index, ref in enumerate(references)
                        if limit is None or len(ref.input_ids) <= limit]
                skipped += len(references) - len(kept)
                served = teacher_forced(lm.client, [ref.input_ids.tolist() for _, ref in kept], k, lm.tokenizer,
                                        batch_size=self.cfg.endpoint_batch_size)
                frames += [served_divergence.served_rows(ref, answer, slice_name, index)
                           for (index, ref), answer in zip(kept, served)]
                lm.prompt_tokens += sum(len(ref.input_ids) for _, ref in kept)
        except served_divergence.NoPromptLogprobs as exc:
            return self._no_divergence(str(exc))
        finally:
            lm.seconds += time.perf_counter() - start
        line = served_divergence.bound_line(k, skipped)
        log.info("%s", line)
        self.params.update({"candidate.divergence": line, "candidate.kl_bound": served_divergence.KL_BOUND,
                            "candidate.divergence_topk": k})
        return pd.concat(frames, ignore_index=True) if frames else served_divergence.empty_rows()

    def _no_divergence(self, reason: str) -> pd.DataFrame:
        line = served_divergence.no_logprobs_line(reason)
        log.warning("%s", line)
        self.params["candidate.divergence"] = line
        return served_divergence.empty_rows()

    def describe(self, reference_model: Any) -> None:
        """Scheme and stored bits per weight of the served checkpoint, when the server names a local directory."""
        if self._lm is None:
            return
        from harness.checkpoint.candidate import describe, linear_shapes

        root = (self._lm.served or {}).get("root")
        directory = Path(str(root)) if root else None
        if directory is None or not (directory / "config.json").is_file():
            return
        scheme = describe(json.loads((directory / "config.json").read_text()), name=self.params["candidate.name"],
                          directory=directory, linear_shapes=linear_shapes(reference_model))
        self.params.update({k: v for k, v in scheme.as_params().items()
                            if k not in ("candidate.name", "candidate.method")})
        self.params["candidate.checkpoint_method"] = scheme.method  # candidate.method stays "served"

    def quant_report(self, reference_model: Any) -> Any:
        from harness.quant.base import QuantReport

        report = QuantReport(scheme=f"external:{served_name(self.cfg)}", method="served",
                             total_params=sum(p.numel() for p in reference_model.parameters()))
        report.notes.append(NOT_MEASURED)
        return report
