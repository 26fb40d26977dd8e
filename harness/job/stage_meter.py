"""What each stage of a job used: peak device memory, peak host memory, tokens and tokens/s.

A :class:`StageMeter` is entered around each stage of :func:`harness.job.pipeline.run`. Per stage it
records the CUDA allocator's peak (``torch.cuda.max_memory_allocated`` on every visible GPU,
summed, reset when the stage starts; only where CUDA exists) and the tokens the model ran
through: a hook on the watched model's input embedding counts its token ids (batch x length,
padding included) as *generated* tokens when the model's call continues a non-empty KV cache one
token per row (a decode step), and as *prefill* tokens otherwise; ``teacher_forced_tokens`` are the
part of those prefill tokens that continued a KV cache several tokens per row (a reply teacher-forced
after its prompt's prefill: computed in parallel, as a prefill is). Tokens/s divides them by the stage's wall
time (the stage's bookkeeping included), which is the rate :mod:`harness.planning.plan` needs to
predict a job's wall time on the same hardware. Host memory is the process's peak resident set
(``getrusage``: a high-water mark over the whole job, sampled at the end of each stage).

The numbers go to summary.json (``resources``, ``throughput``) and, as MLflow metrics, through
:func:`harness.results.tracking.flat_metrics`.
"""
from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("harness")

GB = 1024 ** 3


def host_rss_peak_gb() -> float:
    """Peak resident set size of this process so far, in GiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (GB if sys.platform == "darwin" else 1024 ** 2)


def hardware(machine: dict[str, str]) -> str:
    """The hardware a run's throughput belongs to, from summary.json's ``machine``: the GPU, else the CPU count."""
    return machine.get("gpu") or f"CPU ({machine.get('cpus', '?')} cores)"


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _past_length(past: Any) -> int:
    if past is None:
        return 0
    if hasattr(past, "get_seq_length"):
        return int(past.get_seq_length())
    try:  # legacy tuple-of-tuples cache: [layer][key/value] of [batch, heads, length, dim]
        return int(past[0][0].shape[-2])
    except (IndexError, TypeError, AttributeError):
        return 0


@dataclass
class StageUse:
    seconds: float = 0.0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    teacher_forced_tokens: int = 0  # of prefill_tokens: several tokens per row after a non-empty KV cache
    cuda_peak_bytes: int = 0


@dataclass
class StageMeter:
    """Per-stage memory and token counts of one job (see the module docstring)."""

    stages: dict[str, StageUse] = field(default_factory=dict)
    current: str | None = None
    _hooks: list[Any] = field(default_factory=list)
    _decoding: bool = False  # inside a call of the whole model that continues its KV cache

    def watch(self, model: torch.nn.Module) -> None:
        """Count the tokens of every forward of ``model`` into the current stage.

        Tokens are counted where they enter the input embedding (so paths that call the inner
        model directly, as divergence scoring does, are counted too); a call of the whole model
        that continues a non-empty KV cache marks them as generated.
        """
        self._hooks.append(model.register_forward_pre_hook(self._enter, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._leave))
        self._hooks.append(model.get_input_embeddings().register_forward_pre_hook(self._count))

    def unwatch(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        past = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5 passes ``cache``
        self._decoding = _past_length(past) > 0

    def _leave(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._decoding = False

    def _count(self, module: torch.nn.Module, args: tuple) -> None:
        if self.current is None or not args or not isinstance(args[0], torch.Tensor):
            return
        use = self.stages[self.current]
        tokens = int(args[0].numel())
        if self._decoding and args[0].shape[-1] == 1:
            use.generated_tokens += tokens
        else:
            use.prefill_tokens += tokens
            if self._decoding:
                use.teacher_forced_tokens += tokens

    def begin(self, name: str) -> None:
        self.stages.setdefault(name, StageUse())
        self.current = name
        for index in _cuda_devices():
            torch.cuda.reset_peak_memory_stats(index)

    def end(self, name: str, seconds: float) -> None:
        use = self.stages[name]
        use.seconds += seconds
        peak = sum(torch.cuda.max_memory_allocated(index) for index in _cuda_devices())
        use.cuda_peak_bytes = max(use.cuda_peak_bytes, peak)
        self.current = None

    def resources(self) -> dict[str, Any]:
        """summary.json's ``resources``: host RSS peak and, where CUDA exists, per-stage device peaks."""
        out: dict[str, Any] = {"host_rss_peak_gb": round(host_rss_peak_gb(), 4)}
        if _cuda_devices():
            out["cuda_peak_gb"] = {name: round(use.cuda_peak_bytes / GB, 4) for name, use in self.stages.items()}
        return out

    def throughput(self) -> dict[str, dict[str, float]]:
        """summary.json's ``throughput``: per stage that ran the model, tokens and tokens/s of wall time."""
        out = {}
        for name, use in self.stages.items():
            if use.prefill_tokens == 0 and use.generated_tokens == 0:
                continue
            seconds = max(use.seconds, 1e-9)
            out[name] = {"prefill_tokens": use.prefill_tokens, "generated_tokens": use.generated_tokens,
                         "teacher_forced_tokens": use.teacher_forced_tokens, "seconds": use.seconds,
                         "tokens_per_s": (use.prefill_tokens + use.generated_tokens) / seconds}
        return out
