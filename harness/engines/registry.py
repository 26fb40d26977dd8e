"""The serving engines by name: ``register_engine`` adds one, ``get_engine`` finds it.

``eval.backend=<name>`` names an in-process engine (``hf``, lm-eval's HFLM on the loaded model, is
the evaluation's own default and no engine here). A served candidate's engine is the one that says
it serves the candidate's config (:meth:`~harness.engines.base.ServedEngine.serves`); engines
registered later are asked first, so a plugin engine is preferred to the built-in ones.
"""
from __future__ import annotations

from typing import TypeVar

from harness.config import CandidateConfig
from harness.engines.base import Engine, InProcessEngine, ServedEngine
from harness.errors import UsageError

E = TypeVar("E", bound=type[Engine])

ENGINES: dict[str, type[Engine]] = {}  # name -> engine class, in registration order


def register_engine(name: str, engine: E) -> E:
    """Register ``engine`` (a :class:`ServedEngine` or :class:`InProcessEngine` subclass) under ``name``."""
    if name in ENGINES and ENGINES[name] is not engine:
        raise ValueError(f"engine name {name!r} is taken by {ENGINES[name].__qualname__}")
    ENGINES[name] = engine
    return engine


def engine_names(*, served: bool | None = None) -> list[str]:
    """The registered names, sorted; only the served (or only the in-process) ones when ``served`` is given."""
    return sorted(name for name, engine in ENGINES.items() if served is None or engine.served == served)


def get_engine(name: str) -> type[Engine]:
    """The engine registered as ``name``; a :class:`UsageError` naming the registered ones otherwise."""
    try:
        return ENGINES[name]
    except KeyError:
        raise UsageError(f"no serving engine is registered as {name!r}; registered: "
                         f"{', '.join(engine_names())}") from None


def in_process_engine(name: str) -> type[InProcessEngine]:
    """The in-process engine registered as ``name`` (``eval.backend``); a :class:`UsageError` for any other name."""
    engine = get_engine(name)
    if not issubclass(engine, InProcessEngine):
        raise UsageError(f"{name!r} is a served engine, which answers for candidate.endpoint / candidate.serve, not "
                         f"in this process; in-process engines: {', '.join(engine_names(served=False))}")
    return engine


def served_engine(cfg: CandidateConfig) -> tuple[str, type[ServedEngine]]:
    """(name, class) of the engine that answers for the served candidate ``cfg``: the last registered that serves it."""
    for name, engine in reversed(ENGINES.items()):
        if issubclass(engine, ServedEngine) and engine.serves(cfg):
            return name, engine
    raise UsageError("no registered engine serves this candidate: give candidate.endpoint=<URL> or "
                     f"candidate.serve=<command>; served engines: {', '.join(engine_names(served=True))}")
