"""One progress display for a job: its stages, and per slice the items done of each side.

The pipeline reports to :func:`current` — stages begin and end (``run.Timings``), and while
lm-eval runs a slice, items done of items there are (:func:`lm_eval_requests`, for the
reference or the quantized side, :func:`side`). Outside a job's command line the reporter is
:class:`Reporter`, which logs stage names as the harness always did and leaves lm-eval's own
bars alone: code that imports ``harness`` sees nothing new.

The command line (:func:`harness.infra.joblog.job_console`) installs a :class:`Display`:

* on a terminal, a block redrawn in place (rich's ``Live``): the stages with their times, a
  row per slice with each side's items, tokens/s and ETA; log lines print above it;
* otherwise (a Slurm log, CI, ``> file``) one line per step: a stage that starts or ends, a
  slice that one side has finished, and for a slice still running after
  :data:`LINE_INTERVAL_S`, a line with its count.

rich, not tqdm's ``position=``: two processes (the reference runs in a second one on a CPU,
:mod:`harness.job.background_reference`) each drawing bars at fixed positions overwrite each other
and every log line; here one process draws, the other sends its counts through a queue
(:class:`QueueReporter`), and rich's ``Live`` keeps log lines above the block (tqdm needs
``tqdm.write`` for every print and has no one-line-per-step mode for a file).

Items are counted exactly, not estimated from lm-eval's request bars: an item is done once
every request built from it (one per generation, one per choice of a multiple-choice item)
has its answer, seen where lm-eval stores each answer (its cache hook).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import queue as queue_module
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

log = logging.getLogger("harness")

LINE_INTERVAL_S = 60.0  # without a terminal: a running slice's count at most this often
ETA_MIN_SHARE = 0.1  # an ETA once this share of a slice's items is done ...
ETA_MIN_ITEMS = 3  # ... and at least this many
SIDES = ("reference", "quantized")
REQUEST_METHODS = ("generate_until", "loglikelihood", "loglikelihood_rolling")


class Reporter:
    """Where progress goes when no display is installed: stage names to the log, nothing else."""

    active = False  # a display (here or in the parent process) consumes item counts

    def stage(self, name: str, seconds: float | None = None) -> None:
        """Stage ``name`` starts (``seconds`` None) or ends after ``seconds``."""
        if seconds is None:
            log.info("▶ %s", name)

    def items(self, side: str, slice_name: str, done: int, total: int, tokens: int | None = None) -> None:
        """``done`` of the ``total`` items of ``slice_name`` have their answers on ``side``."""

    def plan(self, slices: list[str]) -> None:
        """The job's slices, in order."""

    def note(self, side_name: str, slice_name: str, text: str) -> None:
        """A side of a slice that needs no counting (e.g. its reference came from the cache)."""

    def follow(self, events: Any) -> None:
        """Read another process's events (a :class:`QueueReporter`'s queue) until it ends."""

    def drain(self, timeout_s: float = 5.0) -> None:
        """Wait until the followed processes' last events are read."""


_reporter: contextvars.ContextVar[Reporter] = contextvars.ContextVar("harness_progress", default=Reporter())
_side: contextvars.ContextVar[str] = contextvars.ContextVar("harness_progress_side", default="quantized")
_token_source: contextvars.ContextVar[Callable[[], int | None]] = contextvars.ContextVar(
    "harness_progress_tokens", default=lambda: None)


def current() -> Reporter:
    return _reporter.get()


@contextlib.contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """``reporter`` receives this context's progress."""
    token = _reporter.set(reporter)
    try:
        yield reporter
    finally:
        _reporter.reset(token)


@contextlib.contextmanager
def side(name: str) -> Iterator[None]:
    """Items counted in this context are ``name``'s (``reference`` or ``quantized``)."""
    token = _side.set(name)
    try:
        yield
    finally:
        _side.reset(token)


def install(reporter: Reporter, side_name: str, tokens: Callable[[], int | None]) -> None:
    """For the rest of a process that is the job's own (its reference process): where progress goes."""
    _reporter.set(reporter)
    _side.set(side_name)
    _token_source.set(tokens)


# ------------------------------------------------------------------ counting lm-eval's items
class _ItemCounter:
    """Items of one slice, done once all their requests are answered."""

    def __init__(self, reporter: Reporter, side_name: str, slice_name: str, tokens: Callable[[], int | None]):
        self.reporter, self.side, self.slice = reporter, side_name, slice_name
        self.tokens = tokens
        self.total = 0
        self.done = 0
        self.pending: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.remaining: collections.Counter = collections.Counter()
        self.offset, self.planned = 0, None  # items done by earlier calls, items planned (lm_eval_requests)

    @staticmethod
    def key(method: str, args: Any) -> tuple:
        # generate_until stores (context, generation kwargs); the others their string arguments
        if method == "generate_until":
            return method, args[0]
        return method, tuple(args)

    def built(self, total: int | None) -> None:
        """lm-eval built the requests of a task of ``total`` items."""
        self.total += int(total or 0)
        self.report()

    def expect(self, method: str, requests: list) -> None:
        for request in requests:
            item = (request.task_name, request.doc_id)
            self.pending[self.key(method, request.args)].append(item)
            self.remaining[item] += 1

    def answered(self, method: str, args: Any) -> None:
        waiting = self.pending.get(self.key(method, args))
        if not waiting:
            return
        item = waiting.popleft()
        self.remaining[item] -= 1
        if self.remaining[item] == 0:
            del self.remaining[item]
            self.done += 1
            self.report()

    def report(self, finished: bool = False) -> None:
        total = max(self.total, self.done + len(self.remaining))
        done = total if finished else self.done  # items answered from a checkpoint count at the end
        if self.planned is not None:
            done, total = self.offset + done, max(int(self.planned), self.offset + total)
        self.reporter.items(self.side, self.slice, done, total, self.tokens())


class _CountingHook:
    """lm-eval's cache hook, seeing every answer before it is stored."""

    def __init__(self, inner: Any, counter: _ItemCounter, method: str):
        self.inner, self.counter, self.method = inner, counter, method

    def add_partial(self, attr: str, req: Any, res: Any) -> None:
        if attr == self.method:
            self.counter.answered(attr, req)
        self.inner.add_partial(attr, req, res)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _QuietBar:
    """Stands in for tqdm inside lm-eval: iterates, counts nothing on screen."""

    def __init__(self, iterable: Any = None, *args: Any, total: int | None = None, **kwargs: Any):
        self.iterable, self.total, self.n = iterable, total, 0

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable if self.iterable is not None else ())

    def __enter__(self) -> "_QuietBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, n: int = 1) -> None:
        self.n += n

    def __getattr__(self, name: str) -> Callable[..., None]:  # close, set_postfix, refresh, ...
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _quiet_lm_eval_bars(on_build: Callable[[int | None], None]) -> Iterator[None]:
    """lm-eval's tqdm bars replaced by :class:`_QuietBar` for the context; the bar over a task's
    documents (``lm_eval.api.task``) says how many items the task has."""
    import tqdm as tqdm_module
    import tqdm.auto

    bars = {tqdm_module.tqdm, tqdm.auto.tqdm}

    def build_bar(iterable: Any = None, *args: Any, total: int | None = None, **kwargs: Any) -> _QuietBar:
        on_build(total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None))
        return _QuietBar(iterable, total=total)

    replaced = []
    for name, module in list(sys.modules.items()):
        if (name == "lm_eval" or name.startswith("lm_eval.")) and getattr(module, "tqdm", None) in bars:
            replaced.append((module, module.tqdm))
            module.tqdm = build_bar if name == "lm_eval.api.task" else _QuietBar
    try:
        yield
    finally:
        for module, original in replaced:
            module.tqdm = original


@contextlib.contextmanager
def _counted_requests(lm: Any, counter: _ItemCounter) -> Iterator[None]:
    """The lm's request methods, for the context, announce their requests and count the answers."""
    added = []
    for method in REQUEST_METHODS:
        original = getattr(lm, method, None)
        if original is None or method in vars(lm):
            continue

        def counted(requests: list, *args: Any, _method: str = method, _original: Any = original,
                    **kwargs: Any) -> Any:
            counter.expect(_method, requests)
            hook = lm.cache_hook
            lm.cache_hook = _CountingHook(hook, counter, _method)
            try:
                return _original(requests, *args, **{**kwargs, "disable_tqdm": True})
            finally:
                lm.cache_hook = hook

        setattr(lm, method, counted)
        added.append(method)
    try:
        yield
    finally:
        for method in added:
            delattr(lm, method)




@contextlib.contextmanager
def token_source(count: Callable[[], int]) -> Iterator[None]:
    """``count()``: tokens this process's model has run so far (for tokens/s)."""
    token = _token_source.set(count)
    try:
        yield
    finally:
        _token_source.reset(token)


@contextlib.contextmanager
def lm_eval_requests(lm: Any, slice_name: str, done_before: int = 0, planned: int | None = None) -> Iterator[None]:
    """While lm-eval evaluates ``slice_name`` on ``lm``: its items counted to the reporter, its bars quiet.

    ``done_before`` / ``planned``: a call evaluating one round of a slice (harness.evaluation.sequential_run)
    reports the slice's items done so far out of the items it may need, not the round's alone.
    Does nothing without an active reporter (library use keeps lm-eval's own bars).
    """
    reporter = current()
    if not reporter.active:
        yield
        return
    counter = _ItemCounter(reporter, _side.get(), slice_name, _token_source.get())
    counter.offset, counter.planned = int(done_before), planned
    with _quiet_lm_eval_bars(counter.built), _counted_requests(lm, counter):
        yield
    counter.report(finished=True)


# ------------------------------------------------------------------- another process's reports
class QueueReporter(Reporter):
    """In a second process: item counts to the parent's display through ``events`` (at most 4 a second)."""

    active = True

    def __init__(self, events: Any, interval_s: float = 0.25):
        self.events, self.interval_s = events, interval_s
        self._last: dict[tuple[str, str], float] = {}

    def stage(self, name: str, seconds: float | None = None) -> None:
        pass  # the parent's stages are the job's

    def items(self, side: str, slice_name: str, done: int, total: int, tokens: int | None = None) -> None:
        now = time.monotonic()
        if done < total and done and now - self._last.get((side, slice_name), 0.0) < self.interval_s:
            return
        self._last[(side, slice_name)] = now
        self.events.put(("items", side, slice_name, done, total, tokens, time.time()))


def end_of_events(events: Any) -> None:
    """Tell the reader of ``events`` that no more will come."""
    events.put(("end",))


# ---------------------------------------------------------------------------------- display
@dataclass
class _Row:
    done: int = 0
    total: int = 0
    started: float | None = None
    ended: float | None = None
    tokens_start: int | None = None
    tokens: int | None = None
    note: str = ""
    last_line: float = 0.0

    def rate(self, now: float) -> float | None:
        if self.started is None or self.done == 0:
            return None
        elapsed = (self.ended or now) - self.started
        return self.done / elapsed if elapsed > 0 else None

    def tokens_per_s(self, now: float) -> float | None:
        if self.started is None or self.tokens is None or self.tokens_start is None:
            return None
        elapsed = (self.ended or now) - self.started
        return (self.tokens - self.tokens_start) / elapsed if elapsed > 0.5 else None

    def eta_s(self, now: float) -> float | None:
        """Time left at the rate so far, once enough is done to estimate it (None before that).

        Items finish in batches, so the first to finish says little about the rest: a long-context
        slice's first item of 48 estimated 1 h 13 min for a stage that took 161 s. No estimate before
        ``ETA_MIN_SHARE`` of the items (and at least ``ETA_MIN_ITEMS``) are done.
        """
        rate = self.rate(now)
        if rate is None or self.ended is not None or self.done < max(ETA_MIN_ITEMS, ETA_MIN_SHARE * self.total):
            return None
        return (self.total - self.done) / rate


class _Header:
    """The block's first line(s): the job's time and its stages, a stage never split across lines."""

    def __init__(self, lead: str, parts: list[str]):
        self.lead, self.parts = lead, parts

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        from rich.text import Text

        lines = [self.lead]
        for part in self.parts:
            if len(lines[-1]) + 2 + len(part) > options.max_width:
                lines.append(part)
            else:
                lines[-1] += ("  " if lines[-1] != self.lead else " ") + part
        for line in lines:
            yield Text(line, no_wrap=True, overflow="crop")


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


@dataclass
class Display(Reporter):
    """The job's display (see the module docstring); ``terminal`` None: detected from ``stream``."""

    stream: Any = None
    terminal: bool | None = None
    active = True
    stages: dict[str, list[float | None]] = field(default_factory=dict)  # name -> [start, seconds]
    rows: dict[tuple[str, str], _Row] = field(default_factory=dict)
    slices: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    on_stage: list[Callable[[], None]] = field(default_factory=list)  # called as each stage begins

    def __post_init__(self) -> None:
        self.stream = self.stream or sys.stdout
        if self.terminal is None:
            self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self._lock = threading.RLock()
        self._live: Any = None
        self._console: Any = None  # set on entering (a terminal): the live block draws only inside ``with``
        self._closed = False
        self._readers: list[threading.Thread] = []

    # -- events
    def plan(self, slices: list[str]) -> None:
        """The job's slices, in order (rows shown before their counts arrive)."""
        with self._lock:
            self._start_live()
            self.slices = list(dict.fromkeys([*self.slices, *slices]))

    def stage(self, name: str, seconds: float | None = None) -> None:
        now = time.time()
        if seconds is None:
            for callback in self.on_stage:
                callback()
        with self._lock:
            self._start_live()
            if seconds is None:
                previous = self.stages.get(name)
                self.stages[name] = [now, None if previous is None else previous[1]]
                if previous is None:  # a stage entered again (the job writes twice) is printed once
                    self._line(f"▶ {name}")
            else:
                entry = self.stages.setdefault(name, [now, None])
                again = entry[1] is not None
                entry[1] = (entry[1] or 0.0) + seconds
                entry[0] = None
                if not again:  # its total goes on in the header
                    self._line(f"✓ {name} {seconds:.1f} s")

    def note(self, side_name: str, slice_name: str, text: str) -> None:
        """A side of a slice that needs no counting (e.g. its reference came from the cache)."""
        with self._lock:
            self._row(side_name, slice_name).note = text

    def items(self, side: str, slice_name: str, done: int, total: int, tokens: int | None = None,
              when: float | None = None) -> None:
        now = when or time.time()
        with self._lock:
            self._start_live()
            row = self._row(side, slice_name)
            if row.started is None:
                row.started, row.tokens_start = now, tokens
            row.done, row.total, row.tokens = done, total, tokens
            if done >= total > 0 and row.ended is None:
                row.ended = now
                self._line(f"{side} · {slice_name}: {self._count(row, now)}")
            elif row.ended is None and not self.terminal and now - (row.last_line or row.started) >= LINE_INTERVAL_S:
                row.last_line = now
                self._line(f"{side} · {slice_name}: {self._count(row, now)}")

    def follow(self, events: Any) -> None:
        reader = threading.Thread(target=self._read, args=(events,), daemon=True, name="harness-progress-reader")
        reader.start()
        self._readers.append(reader)

    def drain(self, timeout_s: float = 5.0) -> None:
        """Wait until every followed queue has delivered its last event."""
        for reader in self._readers:
            reader.join(timeout_s)
        self._readers = [r for r in self._readers if r.is_alive()]

    def _read(self, events: Any) -> None:
        while not self._closed:
            try:
                event = events.get(timeout=1.0)
            except queue_module.Empty:
                continue
            except (EOFError, OSError):
                return
            if event[0] == "end":
                return
            if event[0] == "items":
                self.items(*event[1:6], when=event[6])
            elif event[0] == "log":
                record = event[1]
                logging.getLogger(record.name).handle(record)

    # -- drawing
    def _row(self, side_name: str, slice_name: str) -> _Row:
        if slice_name not in self.slices:
            self.slices.append(slice_name)
        return self.rows.setdefault((side_name, slice_name), _Row())

    def _count(self, row: _Row, now: float) -> str:
        if row.note and row.started is None:
            return row.note
        if row.started is None:
            return "–"
        text = f"{row.done}/{row.total} items"
        speed = row.tokens_per_s(now)
        if speed is not None:
            text += f" · {speed:,.0f} tok/s"
        if row.ended is not None:
            return text + f" · {row.ended - row.started:.1f} s"
        eta = row.eta_s(now)
        return text + (f" · ETA {_clock(eta)}" if eta is not None else "")

    def _line(self, text: str) -> None:
        if self.terminal:
            return  # the live block shows it
        stamp = time.strftime("%H:%M:%S")
        print(f"[{stamp}] {text}", file=self.stream, flush=True)

    def render(self) -> Any:
        """The live block: a line of stages, a table of slices by side."""
        from rich.table import Table

        now = time.time()
        with self._lock:
            parts = []
            for name, (start, seconds) in self.stages.items():
                if start is not None:
                    parts.append(f"▶ {name} {_clock(now - start)}")
                else:
                    parts.append(f"✓ {name} {seconds:.1f}s")
            table = Table(box=None, padding=(0, 2), show_edge=False, header_style="bold")
            table.add_column("slice")
            for side_name in SIDES:
                table.add_column(side_name)
            for slice_name in self.slices:
                cells = []
                for side_name in SIDES:
                    row = self.rows.get((side_name, slice_name))
                    cells.append(self._count(row, now) if row else "–")
                table.add_row(slice_name, *cells)
            from rich.console import Group

            return Group(_Header(f"job {_clock(now - self.started)} ·", parts), table)

    # -- lifetime
    def __enter__(self) -> "Display":
        if self.terminal:
            from rich.console import Console

            self._console = Console(file=self.stream, force_terminal=True)
        return self

    def _start_live(self) -> None:
        """The live block appears with the first event (a tool that reports none draws nothing)."""
        if self._console is None or self._live is not None or self._closed:
            return
        from rich.live import Live

        self._live = Live(get_renderable=self.render, console=self._console, refresh_per_second=4,
                          redirect_stdout=True, redirect_stderr=True, transient=False)
        self._live.start()

    def write_stream(self, stream: Any) -> Any:
        """A stream whose lines print above the live block (for log handlers), or ``stream`` itself."""
        if not self.terminal:
            return stream
        from rich.file_proxy import FileProxy

        return FileProxy(self._console, stream)

    def __exit__(self, *exc: Any) -> None:
        self.drain(timeout_s=2.0)
        with self._lock:
            self._closed = True
        if self._live is not None:
            self._live.stop()
            self._live = None
