"""What a serving engine does, whether it answers in this process or behind a server.

An engine is started (or connected to) once, answers the items of lm-eval's tasks through an lm-eval
model, may return teacher-forced log-probs of whole texts (the token divergence), and is stopped at
the end. Each engine declares what it can and cannot return in its :class:`Capabilities`; the
harness reads them instead of the engine's name.

Two kinds, which differ in what they are built from:

* :class:`ServedEngine`: a server reached over HTTP, built from the served candidate's settings
  (``candidate.endpoint`` / ``candidate.serve`` and ``candidate.endpoint_*``); it answers for the
  candidate, with the prompts and tokens of the reference's own lm-eval wrapper (the "twin");
* :class:`InProcessEngine`: loaded in this process from a checkpoint on disk (``eval.backend=<name>``);
  it answers for both sides.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from harness.config import CandidateConfig
from harness.divergence.topk_bound import NoPromptLogprobs, ServedLogprobs

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


@dataclass(frozen=True)
class Capabilities:
    """What an engine can and cannot return, declared once per engine class."""

    generate: bool  # greedy replies to generation items
    loglikelihood: bool  # log-probs of a continuation: lm-eval's multiple-choice and log-likelihood items
    prompt_logprobs: bool  # teacher-forced log-probs of a whole text's tokens: a served candidate's token divergence
    top_k: int | None  # the most log-probs per position it returns unless told otherwise; None: no fixed limit
    starts_server: bool  # served: the harness starts its server and stops it at the end (False: reaches a running one)


@dataclass(frozen=True)
class ServedModel:
    """What a server says it serves (``/v1/models``)."""

    name: str  # the served model's id
    max_len: int | None = None  # the longest prompt + reply it takes; None: not said
    root: str | None = None  # where it loaded the weights from (vLLM names the checkpoint directory)


class Engine(ABC):
    """A serving engine: started once, asked for answers and log-probs, stopped (also as a context manager)."""

    capabilities: ClassVar[Capabilities]
    served: ClassVar[bool]  # a server over HTTP (True) or this process (False)

    @classmethod
    def summary(cls) -> str:
        """One line for the job log: where it runs and what it returns."""
        caps = cls.capabilities
        where = ("served, started by the harness" if caps.starts_server else "served, reached where it runs") \
            if cls.served else "in this process"
        returns = [name for name, able in (("generation", caps.generate), ("log-likelihood", caps.loglikelihood),
                                           ("prompt log-probs", caps.prompt_logprobs)) if able]
        limit = f" (top-{caps.top_k} at most by default)" if caps.prompt_logprobs and caps.top_k else ""
        return f"{where}; returns {', '.join(returns) or 'nothing'}{limit}"

    @classmethod
    def check(cls) -> None:
        """Refuse, before any work, an engine this machine cannot run (one line with the fix); nothing by default."""

    def start(self) -> Self:
        """Start the engine (a server, a model) or connect to it; itself, once it answers."""
        return self

    @abstractmethod
    def healthy(self) -> bool:
        """Whether the engine answers now."""

    def prompt_logprobs(self, texts: list[list[int]], k: int, tokenizer: Any) -> list[ServedLogprobs]:
        """The engine's log-probs of each text (token ids of ``tokenizer``'s vocabulary), teacher-forced: at each
        position the actual token's and the top ``k``. Raises :class:`NoPromptLogprobs` when it gives none."""
        raise NoPromptLogprobs(f"{type(self).__name__} returns no log-probs of prompt tokens")

    def stop(self) -> None:
        """Stop what :meth:`start` started; safe to call more than once. Nothing by default."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ServedEngine(Engine):
    """An engine behind a server, answering for the served candidate ``cfg`` (see the module)."""

    served = True
    # the side this server answers for, as its messages and config keys name it: candidate, or reference for a served
    # reference (reference.endpoint / reference.serve: its settings arrive as a CandidateConfig of the same fields)
    role = "candidate"

    def __init__(self, cfg: CandidateConfig, results_dir: Path) -> None:
        self.cfg = cfg
        self.results_dir = Path(results_dir)  # where a server the harness starts keeps its log
        self.model: ServedModel | None = None  # set by start()

    @classmethod
    @abstractmethod
    def serves(cls, cfg: CandidateConfig) -> bool:
        """Whether this engine answers for ``cfg`` (its ``candidate.endpoint`` or ``candidate.serve``)."""

    @abstractmethod
    def lm(self, twin: Any) -> Any:
        """The lm-eval model that answers items on this engine (generation and log-likelihood) with the prompts
        and tokens of ``twin``, the reference's own lm-eval wrapper (whose model is never called)."""

    @abstractmethod
    def usage(self) -> dict[str, float]:
        """What the engine was asked so far: ``requests``, ``prompt_tokens``, ``generated_tokens``, ``seconds``."""


class InProcessEngine(Engine):
    """An engine loaded in this process from ``checkpoint`` (a directory or hub id), answering for one side."""

    served = False

    def __init__(self, checkpoint: str, *, max_length: int, seed: int) -> None:
        self.checkpoint, self.max_length, self.seed = checkpoint, max_length, seed

    def healthy(self) -> bool:
        return True

    @abstractmethod
    def lm(self) -> Any:
        """The lm-eval model that answers items on this engine."""
