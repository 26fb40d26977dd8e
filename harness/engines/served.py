"""A served candidate in the job: the artifact that ships, judged on the engine that serves it.

``quant=external candidate.endpoint=http://host:8000`` evaluates whatever an OpenAI-compatible server
serves (the ``openai`` engine); ``quant=external candidate.serve="vllm serve <export> --host 127.0.0.1
--port {port}"`` starts that server first (the ``vllm-serve`` engine: a free loopback port, its log in
the results directory as ``serve.log``) and stops it after the evaluation. The engine is the registered
one that serves the config (:func:`harness.engines.registry.served_engine`). The items are answered by
the engine's lm-eval model with the prompts of the reference's own lm-eval wrapper, so the per-item
records pair with the reference's exactly as a simulated candidate's do: flips, the score test, the
gate and sequential evaluation are unchanged.

Token divergence (:meth:`ServedCandidate.divergence`): each of the reference's divergence texts (the
prompt as evaluated + the reference's own reply) is sent to the engine as token ids for its
teacher-forced top-k log-probs (``candidate.endpoint_divergence_topk``; on the completions API
``echo=true, max_tokens=0, logprobs=k``); NLL and top-1 agreement are exact, and the KL is KL on the
server's top-k partition, a lower bound of the exact KL (:mod:`harness.divergence.topk_bound`),
labelled so in every row, the summary and the tables. An engine that returns no log-probs gives
accuracy and flips only, and the run says so in one line.

What a served candidate does not give: a per-layer weight report (its weights are in the server, not
in this process); the run's notes say so. When the server names a local checkpoint directory (vLLM's
``/v1/models`` ``root``: :attr:`ServedCandidate.checkpoint_dir`), the job reads its scheme and *stored*
bits per weight from that directory's config and safetensors headers
(:func:`harness.checkpoint.candidate.served_params`).

Secrets: the API key is read from the environment variable ``candidate.endpoint_api_key_env`` names,
at each request, into the ``Authorization`` header only. A URL with credentials in it and a serve
command with ``--api-key`` are refused before any work: the config is logged (MLflow params, job log).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pandas as pd

from harness.config import CandidateConfig
from harness.divergence import topk_bound as served_divergence
from harness.divergence.scoring import ReferenceText
from harness.engines.openai_http import redact_url
from harness.engines.registry import served_engine
from harness.engines.served_config import served_name

log = logging.getLogger(__name__)

NOT_MEASURED = ("served candidate: answered over HTTP; its weights stay in the server (no per-layer weight "
                "report), and its KL, where the server returns prompt log-probs, is a lower bound from their top-k")


class ServedCandidate:
    """The job's served candidate: its engine (picked from the registry) and the engine's lm-eval model."""

    def __init__(self, cfg: CandidateConfig, results_dir: Path, role: str = "candidate"):
        self.cfg = cfg
        self.engine_name, engine = served_engine(cfg)
        self.engine = engine(cfg, Path(results_dir))
        self.engine.role = role
        self._lm: Any = None
        self._tokenizer: Any = None  # the reference's, whose token ids the divergence texts are
        self.params: dict[str, Any] = {"candidate.name": served_name(cfg), "candidate.method": "served",
                                       "candidate.endpoint": redact_url(cfg.endpoint) if cfg.endpoint else "serve"}

    def start(self) -> ServedCandidate:
        """Start the engine (a server the harness serves) or connect to it; what it serves lands in the parameters."""
        self.engine.start()
        log.info("candidate engine %s: %s", self.engine_name, self.engine.summary())
        served = self.engine.model
        if served is not None:
            self.params["candidate.served_model"] = served.name
            if served.max_len:
                self.params["candidate.max_model_len"] = served.max_len
        return self

    @property
    def checkpoint_dir(self) -> Path | None:
        """The checkpoint directory the server names (vLLM's ``root``), when it is one on this machine; else None."""
        root = self.engine.model.root if self.engine.model is not None else None
        return Path(root) if root and (Path(root) / "config.json").is_file() else None

    def stop(self) -> None:
        """Stop the engine (a server the harness started); what it was asked lands in the run's parameters."""
        if self._lm is not None:
            self.params.update({f"candidate.endpoint_{key}": value for key, value in self.engine.usage().items()})
        self.engine.stop()

    def lm(self, twin: Any) -> Any:
        """The engine's lm-eval model (made once: its tokenizer probe runs once per job)."""
        if self._lm is None:
            self._lm = self.engine.lm(twin)
            self._tokenizer = twin.tokenizer
        return self._lm

    def divergence(self, texts: dict[str, list[ReferenceText]]) -> pd.DataFrame:
        """Token rows of the served candidate on each slice's divergence texts (``texts``: slice -> the
        reference's texts), from the engine's teacher-forced top-k log-probs: KL as a top-k lower bound.

        Says what was measured in one line (``candidate.divergence`` in the run's summary, and the log);
        an engine without log-probs gives no rows, and that line says accuracy and flips only.
        """
        k = int(self.cfg.endpoint_divergence_topk)
        if self._lm is None or k == 0:
            why = "candidate.endpoint_divergence_topk=0" if k == 0 else "the endpoint answered no items"
            return self._no_divergence(why)
        limit = self.engine.model.max_len if self.engine.model is not None else None
        frames, skipped = [], 0
        try:
            for slice_name, references in texts.items():
                kept = [(index, ref) for index, ref in enumerate(references)
                        if limit is None or len(ref.input_ids) <= limit]
                skipped += len(references) - len(kept)
                served = self.engine.prompt_logprobs([ref.input_ids.tolist() for _, ref in kept], k, self._tokenizer)
                # a position the server gave no log-prob for (NaN: llama.cpp's echo at BOS tokens) is left out
                frames += [served_divergence.served_rows(ref, answer, slice_name, index).dropna(subset=["nll_quant"])
                           for (index, ref), answer in zip(kept, served)]
        except served_divergence.NoPromptLogprobs as exc:
            return self._no_divergence(str(exc))
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

    def quant_report(self, reference_model: Any) -> Any:
        """The served candidate's report: no weights seen (no SQNR), but its checkpoint's *stored* bits per
        weight (``candidate.bits_per_weight``, read from the directory the server names) on the reference's
        linears, so summary.json's ``quant.bits_per_weight``, the ledger and the decode floor count what
        ships. Without a local checkpoint the bits are not known, and the report says so
        (``bits_known`` false: the run's summary leaves them out)."""
        from harness.quant import QuantReport
        from harness.quant.report import linear_census

        report = QuantReport(scheme=f"external:{served_name(self.cfg)}", method="served",
                             total_params=sum(p.numel() for p in reference_model.parameters()))
        report.notes.append(NOT_MEASURED)
        bits = self.params.get("candidate.bits_per_weight")
        if not isinstance(bits, (int, float)) or not bits > 0:
            report.bits_known = False
            return report
        kept = [name for name in str(self.params.get("candidate.kept") or "").split(",") if name]
        report.kept_params, report.output_head, report.input_embedding = linear_census(reference_model, kept)
        for name, module in reference_model.named_modules():
            weight = getattr(module, "weight", None)
            if (hasattr(module, "out_features") and weight is not None and weight.dim() == 2
                    and name != report.output_head and name not in kept):
                report.add_stored_layer(name, int(weight.shape[0]), int(weight.shape[1]), float(bits))
        return report
