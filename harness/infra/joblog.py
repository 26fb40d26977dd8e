"""A job's console: the harness's own messages and the progress display; the rest in ``job.log``.

Libraries (lm-eval, transformers, datasets, accelerate, the HF hub, MLflow, Python warnings)
log what their developers need: "`pretrained` model kwarg is not of type `str`" six times a
job, "Custom kwargs can be passed to `--metadata`" twice per task. A user of the harness can
act on none of it. :func:`job_console`, entered by the command line only (``python -m
harness``, :func:`harness.cli.main`), sends everything logged to ``results/<run>/job.log``
(logged to MLflow with the run's other files) and keeps on the console the ``harness``
loggers' messages and, from anyone else, errors, as one line that points at the log. With
``verbose`` (``hydra.verbose=true``, ``-v`` for the tools) the console shows everything again.

Whatever it changes — handlers of the library loggers, filters and streams of the console
handlers, the capture of Python warnings — is put back on exit; code that imports ``harness``
and calls :func:`harness.job.pipeline.run` itself keeps its logging as it was.
"""
from __future__ import annotations

import contextlib
import contextvars
import io
import logging
import logging.handlers
import os
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator

from harness.infra import progress

log = logging.getLogger("harness")

# Loggers that print through handlers of their own (not the root's): folded into the root's for the job.
OWN_HANDLERS = ("transformers", "datasets", "huggingface_hub", "accelerate", "lm_eval", "mlflow", "alembic")
LOG_FORMAT = "[%(asctime)s][%(processName)s][%(name)s][%(levelname)s] - %(message)s"


def harness_record(record: logging.LogRecord) -> bool:
    """Written by the harness for its user (the ``harness`` loggers), not by a library."""
    return record.name == "harness" or record.name.startswith("harness.")


class _ConsoleFilter(logging.Filter):
    """The console keeps the harness's messages and anyone's errors; counts what it leaves to the log."""

    def __init__(self) -> None:
        super().__init__()
        self.left = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if harness_record(record) or record.levelno >= logging.ERROR:
            return True
        if record.levelno >= logging.WARNING and not getattr(record, "_harness_left", False):
            record._harness_left = True  # counted once, however many console handlers see it
            self.left += 1
        return False


class _OneLine(logging.Formatter):
    """A library's error on the console as one line that points at the log; the harness's as formatted."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if harness_record(record):
            return self.inner.format(record)
        first = (record.getMessage().strip().splitlines() or [""])[0]
        return f"{record.levelname.lower()} from {record.name}: {first[:200]} (details in job.log)"


class JobLog:
    """The job's log file: a temporary one until :meth:`attach` names the results directory."""

    def __init__(self) -> None:
        handle, name = tempfile.mkstemp(prefix="harness-job-", suffix=".log")
        os.close(handle)
        self.path = Path(name)
        self.attached = False
        self.handler = self._open()

    def _open(self) -> logging.FileHandler:
        handler = logging.FileHandler(self.path, mode="a", encoding="utf-8")
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.setLevel(logging.DEBUG)
        return handler

    def attach(self, directory: Path) -> Path:
        """Continue the log as ``directory/job.log`` (appended to an earlier attempt's)."""
        target = directory / "job.log"
        if self.path == target:
            return target
        self.handler.acquire()
        try:
            self.handler.flush()
            self.handler.stream.close()
            with open(target, "a", encoding="utf-8") as out, open(self.path, encoding="utf-8") as tmp:
                shutil.copyfileobj(tmp, out)
            if not self.attached:
                self.path.unlink(missing_ok=True)
            self.path, self.attached = target, True
            self.handler.baseFilename = str(target)
            self.handler.stream = self.handler._open()
        finally:
            self.handler.release()
        return target

    def close(self) -> None:
        self.handler.close()


_active: contextvars.ContextVar[JobLog | None] = contextvars.ContextVar("harness_job_log", default=None)


def attach(directory: Path) -> Path | None:
    """The running job's log moves to ``directory/job.log``; None outside :func:`job_console`."""
    job_log = _active.get()
    return None if job_log is None else job_log.attach(Path(directory))


@contextlib.contextmanager
def _stderr_descriptor_to_log() -> Iterator[Any]:
    """What is written to file descriptor 2 without Python (a subprocess: lm-eval runs ``git`` for its
    commit hash, which says "fatal: not a git repository" outside one; C libraries; the reference process
    before its logging is set up) becomes records of the ``stderr`` logger, for the job's log: on a
    terminal such bytes land under the progress block and tear it. Python's ``sys.stderr`` keeps the
    terminal (yielded: a stream on the original descriptor)."""
    try:
        original = os.dup(2)
    except OSError:
        yield sys.stderr
        return
    read_end, write_end = os.pipe()
    terminal = os.fdopen(os.dup(original), "w", buffering=1, encoding="utf-8", errors="replace")
    saved = sys.stderr
    sys.stderr.flush()
    os.dup2(write_end, 2)
    os.close(write_end)
    sys.stderr = terminal
    logger = logging.getLogger("stderr")

    def pump() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                text = line.decode("utf-8", errors="replace").rstrip()
                if text:
                    logger.info("%s", text)

    reader = threading.Thread(target=pump, daemon=True, name="harness-stderr-to-log")
    reader.start()
    try:
        yield terminal
    finally:
        sys.stderr = saved
        os.dup2(original, 2)  # the pipe's last writer in this process is gone: the reader ends
        os.close(original)
        reader.join(timeout=2.0)  # a child still holding the pipe keeps it open: not waited for
        terminal.flush()


def _console_handlers() -> list[logging.StreamHandler]:
    return [h for h in logging.getLogger().handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


@contextlib.contextmanager
def job_console(verbose: bool = False, stream: Any = None) -> Iterator[progress.Display]:
    """The console of one command-line job (see the module docstring); yields its progress display."""
    job_log = JobLog()
    root = logging.getLogger()
    folded: dict[str, tuple[list[logging.Handler], bool]] = {}  # logger: (handlers taken off, propagate before)
    saved_level = root.level
    console = _console_handlers()
    saved_console = [(h, h.stream, h.formatter) for h in console]
    saved_stderr = sys.stderr
    console_filter = _ConsoleFilter()
    display = progress.Display(stream=stream or sys.stdout)
    token = _active.set(job_log)
    root.addHandler(job_log.handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)

    def fold_libraries() -> None:
        """Their records reach the root's handlers: the log, and the console's filter. Again at each
        stage: a library imported later (MLflow, in the logging stage) sets up its handlers then."""
        for name in OWN_HANDLERS:
            library = logging.getLogger(name)
            if verbose:
                if not library.propagate and job_log.handler not in library.handlers:
                    library.addHandler(job_log.handler)
                continue
            streams = [h for h in library.handlers
                       if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
            if name not in folded and (streams or not library.propagate):  # as it was before the first change
                folded[name] = ([], library.propagate)
            for handler in streams:
                library.removeHandler(handler)
                folded[name][0].append(handler)
            library.propagate = True

    fold_libraries()
    display.on_stage.append(fold_libraries)
    if not verbose:
        for handler in console:
            handler.addFilter(console_filter)
            handler.setFormatter(_OneLine(handler.formatter))
    quiet_mlflow = not verbose and "MLFLOW_CONFIGURE_LOGGING" not in os.environ
    if quiet_mlflow:  # MLflow, imported later, then leaves its records to the root's handlers
        os.environ["MLFLOW_CONFIGURE_LOGGING"] = "false"
    capturing = logging._warnings_showwarning is not None  # someone captures warnings already: leave it on
    with warnings.catch_warnings():
        try:
            # descriptor 2 is drained (its last lines logged) before the log's handler comes off below
            with _stderr_descriptor_to_log() as terminal_stderr:
                logging.captureWarnings(True)  # py.warnings: to the log (and, verbose, the console)
                with display, progress.reporting(display):
                    for handler, handler_stream, _ in saved_console:  # log lines print above the live block
                        stream_now = terminal_stderr if handler_stream is saved_stderr else handler_stream
                        handler.setStream(display.write_stream(stream_now))
                    yield display
        finally:
            logging.captureWarnings(capturing)
            if quiet_mlflow:
                os.environ.pop("MLFLOW_CONFIGURE_LOGGING", None)
            for handler, handler_stream, formatter in saved_console:
                handler.setStream(handler_stream)
                handler.setFormatter(formatter)
                handler.removeFilter(console_filter)
            for name in OWN_HANDLERS:
                logging.getLogger(name).removeHandler(job_log.handler)
            for name, (taken, propagate) in folded.items():
                library = logging.getLogger(name)
                for handler in taken:
                    library.addHandler(handler)
                library.propagate = propagate
            root.removeHandler(job_log.handler)
            root.setLevel(saved_level)
            _active.reset(token)
            job_log.close()
            if job_log.attached or (console_filter.left and job_log.path.exists()):
                left = f"; {console_filter.left} library message(s) kept off the console" if console_filter.left else ""
                print(f"job log: {job_log.path}{left}", file=stream or sys.stdout)
            elif job_log.path.exists():
                job_log.path.unlink()


class _EventHandler(logging.handlers.QueueHandler):
    """A second process's log records, as ``("log", record)`` events for the parent's display to re-log."""

    def enqueue(self, record: logging.LogRecord) -> None:
        self.queue.put(("log", record))


def child_logging(events: Any, label: str) -> None:
    """In a second process of the job: every record to the parent (``events``), messages prefixed ``label``.

    The parent logs them again (:meth:`harness.infra.progress.Display.follow`): the harness's on its
    console, the libraries' in its job.log. For the process's whole life (it is the job's own).
    """
    handler = _EventHandler(events)
    handler.setFormatter(logging.Formatter(f"[{label}] %(message)s"))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    for name in OWN_HANDLERS:
        library = logging.getLogger(name)
        library.handlers = [h for h in library.handlers if not isinstance(h, logging.StreamHandler)]
        library.propagate = True
    logging.captureWarnings(True)
    # Whatever writes to this process's stdout/stderr (a library's handler set up later, a print, a bar)
    # reaches the parent's log as records, not its terminal, where it would tear the progress block.
    sys.stdout = sys.stderr = _LinesToLog(logging.getLogger(f"{label.replace(' ', '_')}.output"))


class _LinesToLog(io.TextIOBase):
    """A text stream whose lines become INFO records of ``logger``."""

    def __init__(self, logger: logging.Logger):
        self.logger, self.buffer_text = logger, ""

    def write(self, text: str) -> int:
        self.buffer_text += text.replace("\r", "\n")
        *lines, self.buffer_text = self.buffer_text.split("\n")
        for line in lines:
            if line.strip():
                self.logger.info("%s", line.rstrip())
        return len(text)

    def isatty(self) -> bool:
        return False
