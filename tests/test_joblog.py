"""Libraries' messages to the job's log, the harness's on the console, everything put back afterwards."""
from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path

import pytest

from harness.infra import joblog
from harness.infra import progress


@pytest.fixture
def console():
    """A console handler on the root logger, as Hydra's job logging sets one up."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    root = logging.getLogger()
    saved_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield stream
    root.removeHandler(handler)
    root.setLevel(saved_level)


@pytest.fixture
def transformers_like():
    """A library logger with a stream handler of its own and no propagation (as transformers sets up)."""
    library = logging.getLogger("transformers")
    stream = io.StringIO()
    own = logging.StreamHandler(stream)
    saved = library.handlers[:], library.propagate
    library.handlers, library.propagate = [own], False
    yield own, stream
    library.handlers, library.propagate = saved


def emit_job_messages() -> None:
    logging.getLogger("lm_eval.models.huggingface").warning("`pretrained` model kwarg is not of type `str`.")
    logging.getLogger("transformers.modeling_utils").warning("Some weights were not initialized\nsecond line")
    logging.getLogger("harness").warning("SHARED TRACKING STORE: parallel jobs on one SQLite file")
    logging.getLogger("harness.models.loading").info("loaded tiny_random in 0.4s")
    logging.getLogger("datasets").error("dataset script failed\nTraceback (most recent call last): ...")
    with warnings.catch_warnings():  # every call emits it: an earlier test's emission must not dedupe it away
        warnings.simplefilter("always")
        warnings.warn("torch.tensor results are registered as constants", UserWarning)


def test_library_messages_go_to_the_job_log_and_the_harness_stays_on_the_console(console, transformers_like, tmp_path):
    own, own_stream = transformers_like
    out = io.StringIO()
    with joblog.job_console(stream=out):
        emit_job_messages()
        assert joblog.attach(tmp_path) == tmp_path / "job.log"
        logging.getLogger("accelerate").warning("after the results dir is known")
    shown = console.getvalue()
    assert "SHARED TRACKING STORE" in shown and "loaded tiny_random" in shown
    assert "pretrained" not in shown and "Some weights" not in shown and "registered as constants" not in shown
    error_lines = [line for line in shown.splitlines() if "dataset script failed" in line]
    assert error_lines == ["error from datasets: dataset script failed (details in job.log)"]
    assert "Traceback" not in shown
    assert own_stream.getvalue() == ""  # the library's own handler printed nothing during the job
    log = (tmp_path / "job.log").read_text()
    for text in ("`pretrained` model kwarg", "Some weights were not initialized\nsecond line", "SHARED TRACKING",
                 "Traceback (most recent call last)", "registered as constants", "after the results dir is known"):
        assert text in log, text
    assert out.getvalue() == f"job log: {tmp_path / 'job.log'}; 4 library message(s) kept off the console\n"


def test_everything_is_put_back_afterwards(console, transformers_like):
    own, _ = transformers_like
    root, library = logging.getLogger(), logging.getLogger("transformers")
    handlers_before, level_before = root.handlers[:], root.level
    library_before = library.handlers[:]  # its own, and pytest's capture (it attaches to non-propagating loggers)
    assert own in library_before
    console_handler = root.handlers[-1]
    formatter, stream = console_handler.formatter, console_handler.stream
    with joblog.job_console(stream=io.StringIO()):
        assert progress.current().active
        assert library.handlers == [] and library.propagate
    assert root.handlers == handlers_before and root.level == level_before
    assert console_handler.formatter is formatter and console_handler.stream is stream
    assert console_handler.filters == []
    assert library.handlers == library_before and not library.propagate
    assert not progress.current().active
    assert logging._warnings_showwarning is None  # Python warnings no longer captured
    assert joblog.attach(Path("results/any")) is None  # no job: nothing to attach


@pytest.fixture
def propagating_transformers():
    """The "transformers" logger as a fresh process has it (propagating, no handler of its own): an earlier
    test that imported transformers may have given it its own stderr handler and turned propagation off,
    and then its messages reach the terminal through that handler, not the root console this test reads."""
    library = logging.getLogger("transformers")
    saved = library.handlers[:], library.propagate
    library.handlers, library.propagate = [], True
    yield
    library.handlers, library.propagate = saved


def test_verbose_shows_every_message_on_the_console_and_still_logs_them(console, propagating_transformers, tmp_path):
    with joblog.job_console(verbose=True, stream=io.StringIO()):
        joblog.attach(tmp_path)
        emit_job_messages()
    shown = console.getvalue()
    assert "`pretrained` model kwarg" in shown and "Some weights were not initialized\nsecond line" in shown
    assert "registered as constants" in shown
    assert "`pretrained` model kwarg" in (tmp_path / "job.log").read_text()


def test_a_tool_that_logs_nothing_leaves_no_log_behind(console, monkeypatch, tmp_path):
    monkeypatch.setattr(joblog.tempfile, "tempdir", str(tmp_path))
    out = io.StringIO()
    with joblog.job_console(stream=out):
        logging.getLogger("harness").info("gate: pass")
    assert out.getvalue() == "" and list(tmp_path.iterdir()) == []


def test_a_job_that_fails_before_its_results_dir_points_at_its_log(console, monkeypatch, tmp_path):
    monkeypatch.setattr(joblog.tempfile, "tempdir", str(tmp_path))
    out = io.StringIO()
    with pytest.raises(RuntimeError), joblog.job_console(stream=out):
        logging.getLogger("huggingface_hub").warning("cannot reach the hub")
        raise RuntimeError("model cannot be loaded")
    [log] = list(tmp_path.iterdir())
    assert "cannot reach the hub" in log.read_text()
    assert out.getvalue() == f"job log: {log}; 1 library message(s) kept off the console\n"


def test_a_resumed_job_appends_to_its_earlier_log(console, tmp_path):
    (tmp_path / "job.log").write_text("first attempt\n")
    with joblog.job_console(stream=io.StringIO()):
        logging.getLogger("lm_eval").warning("before the results dir")
        joblog.attach(tmp_path)
    text = (tmp_path / "job.log").read_text()
    assert text.startswith("first attempt\n") and "before the results dir" in text


@pytest.mark.parametrize("argv, shown", [([], False), (["-v"], True), (["--verbose"], True)])
def test_the_tools_keep_library_messages_off_the_console_unless_verbose(console, argv, shown):
    from harness import cli

    tool = cli.Tool(prog="python -m harness.example", summary="an example tool")

    def body(parsed: cli.Parsed) -> int:
        logging.getLogger("huggingface_hub").warning("unauthenticated requests to the hub")
        logging.getLogger("harness").info("the tool's own result")
        return 0

    assert cli.main(tool, body, argv) == 0
    assert "the tool's own result" in console.getvalue()
    assert ("unauthenticated requests to the hub" in console.getvalue()) is shown


def test_a_subprocess_writing_to_stderr_goes_to_the_job_log(console, tmp_path, capfd):
    import subprocess
    import sys

    with joblog.job_console(stream=io.StringIO()):
        joblog.attach(tmp_path)
        subprocess.run(["sh", "-c", "echo 'fatal: not a git repository' >&2"], check=True)  # as lm-eval's git call
        print("python's own stderr", file=sys.stderr)
    err = capfd.readouterr().err
    assert "fatal: not a git repository" not in err and "python's own stderr" in err
    assert "[stderr][INFO] - fatal: not a git repository" in (tmp_path / "job.log").read_text()
