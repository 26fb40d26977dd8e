"""The served candidate's settings (``candidate.endpoint`` / ``candidate.serve``), checked before any work.

:mod:`harness.checkpoint.candidate` refuses a contradictory candidate config with :func:`check_config`,
and names a served one with :func:`served_name`, before any engine is built.
"""
from __future__ import annotations

import re
import shlex
import urllib.parse
from pathlib import Path

from harness.config import CandidateConfig
from harness.engines.openai_http import redact_url
from harness.errors import UsageError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_config(cfg: CandidateConfig, scheme_name: str) -> None:
    """Refuse, before any work, a served candidate the job could not run or that would log a secret."""
    if cfg.endpoint and cfg.serve:
        raise UsageError("candidate.endpoint and candidate.serve are both set: give the URL of a running server, "
                         "or a command for the harness to start, not both")
    if cfg.path:
        raise UsageError(f"candidate.path={cfg.path} loads a checkpoint in this process, candidate.endpoint/serve "
                         "evaluate a served one: give one (to serve it: candidate.serve='vllm serve "
                         f"{cfg.path} --host 127.0.0.1 --port {{port}}')")
    if not scheme_name.startswith("external") and scheme_name != "none":
        raise UsageError(f"candidate.{'serve' if cfg.serve else 'endpoint'} is a served candidate, so the harness "
                         f"quantizes nothing itself; use quant=external (got quant={scheme_name})")
    if cfg.endpoint:
        parts = urllib.parse.urlsplit(cfg.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"candidate.endpoint={redact_url(cfg.endpoint)!r} is not an http(s) URL; give the "
                             "server's base URL, e.g. http://127.0.0.1:8000")
        if parts.username or parts.password:
            raise UsageError("candidate.endpoint has credentials in it, and the config is logged (MLflow, job log): "
                             "put the key in an environment variable and name it in candidate.endpoint_api_key_env")
    if cfg.serve:
        if "{port}" not in cfg.serve:
            raise UsageError(f"candidate.serve={cfg.serve!r} has no {{port}}: the harness picks a free loopback "
                             "port and puts it there, e.g. 'vllm serve <dir> --host 127.0.0.1 --port {port}'")
        if re.search(r"--api[-_]key\b", cfg.serve):
            raise UsageError("candidate.serve passes --api-key on its command line, which the config (and MLflow) "
                             "records: export the key instead (vLLM reads VLLM_API_KEY) and name that variable in "
                             "candidate.endpoint_api_key_env")
    if cfg.endpoint_api_key_env is not None and not ENV_NAME.fullmatch(cfg.endpoint_api_key_env):
        raise UsageError("candidate.endpoint_api_key_env takes the NAME of an environment variable (e.g. "
                         "VLLM_API_KEY) that holds the key, and the value given is not a variable name")
    if cfg.endpoint_divergence_topk < 0:
        raise UsageError(f"candidate.endpoint_divergence_topk={cfg.endpoint_divergence_topk}: give the number of "
                         "log-probs to ask per position (20 is vLLM's default cap), or 0 for no token divergence")
    if cfg.endpoint_timeout_s <= 0 or cfg.endpoint_batch_size < 1 or cfg.serve_startup_s <= 0 or \
            cfg.endpoint_concurrency < 1:
        raise UsageError(f"candidate.endpoint_timeout_s={cfg.endpoint_timeout_s}, endpoint_batch_size="
                         f"{cfg.endpoint_batch_size}, endpoint_concurrency={cfg.endpoint_concurrency}, "
                         f"serve_startup_s={cfg.serve_startup_s}: each must be positive")


def served_name(cfg: CandidateConfig) -> str:
    """A label for runs: the served model's id, the directory the serve command names, or host-port."""
    if cfg.endpoint_model:
        base = cfg.endpoint_model
    elif cfg.serve:
        directories = [word for word in shlex.split(cfg.serve) if "{" not in word and Path(word).is_dir()]
        base = f"served-{Path(directories[0]).name}" if directories else "served"
    else:
        parts = urllib.parse.urlsplit(cfg.endpoint or "")
        base = f"endpoint-{parts.hostname}-{parts.port or 80}"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", base)
