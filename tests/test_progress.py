"""The job's progress display and its item counts, on fake lm-eval models and events (no model)."""
from __future__ import annotations

import collections
import io
import logging
import queue
import random
import sys
import types

import pytest

from harness.infra import progress


class Instance:
    """The two fields of lm-eval's Instance the counter reads, and its arguments."""

    def __init__(self, task_name: str, doc_id: int, args: tuple):
        self.task_name, self.doc_id, self.args = task_name, doc_id, args


class Hook:
    def __init__(self) -> None:
        self.stored: list[tuple] = []

    def add_partial(self, attr, req, res) -> None:
        self.stored.append((attr, req, res))


class FakeLM:
    """Answers requests in a shuffled order, storing each answer through its cache hook as HFLM does."""

    def __init__(self, seed: int = 0) -> None:
        self.cache_hook = Hook()
        self.random = random.Random(seed)
        self.tqdm_disabled: list[bool] = []

    def generate_until(self, requests, disable_tqdm: bool = False):
        self.tqdm_disabled.append(disable_tqdm)
        order = list(range(len(requests)))
        self.random.shuffle(order)
        for i in order:
            context, gen_kwargs = requests[i].args
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), f"answer {i}")
        return [f"answer {i}" for i in range(len(requests))]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self.tqdm_disabled.append(disable_tqdm)
        order = list(range(len(requests)))
        self.random.shuffle(order)
        for i in order:
            self.cache_hook.add_partial("loglikelihood", requests[i].args, (-1.0, False))
        return [(-1.0, False)] * len(requests)


class Recorder(progress.Reporter):
    """Item counts as reported, and how many answers were stored at each (``answers``: the hook's list)."""

    active = True

    def __init__(self, answers: list | None = None) -> None:
        self.events: list[tuple] = []
        self.answers, self.answered = answers, []

    def items(self, side, slice_name, done, total, tokens=None):
        self.events.append((side, slice_name, done, total))
        self.answered.append(len(self.answers) if self.answers is not None else None)


def test_an_item_is_done_once_every_one_of_its_requests_is_answered():
    lm = FakeLM(seed=3)
    recorder = Recorder(answers=lm.cache_hook.stored)
    generation = [Instance("gen", i, (f"question {i}", {"until": ["\n"]})) for i in range(5)]
    # three multiple-choice items of four choices; items 1 and 2 have the very same requests
    choices = [Instance("mc", d, (f"context {min(d, 1)}", f" choice {c}")) for d in range(3) for c in range(4)]
    with progress.reporting(recorder), progress.side("reference"), progress.lm_eval_requests(lm, "math"):
        lm.generate_until(generation)
        after_generation = len(recorder.events)
        lm.loglikelihood(choices)
    assert recorder.events[after_generation - 1] == ("reference", "math", 5, 5)
    assert recorder.events[-1] == ("reference", "math", 8, 8)
    # independently: after each answer, item 0 is done once its 4 choices are answered, items 1 and 2
    # (identical requests) once every choice is answered once, and twice
    for (_, _, done, _), answered in zip(recorder.events[after_generation:], recorder.answered[after_generation:]):
        stored = lm.cache_hook.stored[:answered + 1]
        seen = collections.Counter(req for attr, req, _ in stored if attr == "loglikelihood")
        expected = (all(seen[("context 0", f" choice {c}")] >= 1 for c in range(4))
                    + all(seen[("context 1", f" choice {c}")] >= 1 for c in range(4))
                    + all(seen[("context 1", f" choice {c}")] >= 2 for c in range(4)))
        assert done == 5 + expected
    assert len(recorder.events) - after_generation == 3 + 1  # one report per finished item, one at the end
    # lm-eval's bars off inside, its answers still stored, the model as it was afterwards
    assert lm.tqdm_disabled == [True, True]
    assert len(lm.cache_hook.stored) == 5 + 12 and isinstance(lm.cache_hook, Hook)
    assert "generate_until" not in vars(lm) and "loglikelihood" not in vars(lm)


@pytest.fixture
def task_module(monkeypatch):
    """A stand-in for ``lm_eval.api.task`` with tqdm imported as lm-eval imports it."""
    import tqdm

    module = types.ModuleType("lm_eval.api.task")
    module.tqdm = tqdm.tqdm
    monkeypatch.setitem(sys.modules, "lm_eval.api.task", module)
    return module


def test_lm_evals_task_bar_gives_the_items_and_is_put_back(task_module):
    import tqdm

    recorder, lm = Recorder(), FakeLM()
    with progress.reporting(recorder), progress.lm_eval_requests(lm, "math"):
        assert task_module.tqdm is not tqdm.tqdm
        docs = list(task_module.tqdm(range(18), total=18))  # lm-eval building a task's requests
        assert docs == list(range(18))
        lm.generate_until([Instance("gen", i, (f"q{i}", {})) for i in range(18)])
    assert task_module.tqdm is tqdm.tqdm
    assert recorder.events[0] == ("quantized", "math", 0, 18) and recorder.events[-1] == ("quantized", "math", 18, 18)


def test_items_from_a_checkpoint_count_when_the_slice_ends(task_module):
    lm, recorder = FakeLM(), Recorder()
    with progress.reporting(recorder), progress.lm_eval_requests(lm, "code"):
        list(task_module.tqdm(range(3), total=3))
        lm.generate_until([Instance("gen", 2, ("the one request not in the checkpoint", {}))])
    assert recorder.events == [("quantized", "code", 0, 3), ("quantized", "code", 1, 3), ("quantized", "code", 3, 3)]


def test_library_use_without_a_display_changes_nothing():
    lm = FakeLM()
    assert not progress.current().active
    with progress.lm_eval_requests(lm, "math"):
        assert "generate_until" not in vars(lm)
        lm.generate_until([Instance("gen", 0, ("q", {}))])
    assert lm.tqdm_disabled == [False]  # lm-eval's own bar, as before


def test_without_a_terminal_one_line_per_step():
    out = io.StringIO()
    display = progress.Display(stream=out, terminal=False)
    with display:
        display.plan(["math", "code"])
        display.stage("evaluate")
        for done in range(0, 19):
            display.items("quantized", "math", done, 18, tokens=100 * done)
        display.stage("evaluate", 12.5)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "▶ evaluate", lines[1].split("] ", 1)[1], "✓ evaluate 12.5 s"]
    assert lines[1].split("] ", 1)[1].startswith("quantized · math: 18/18 items")


def test_without_a_terminal_a_long_slice_reports_its_count_now_and_then(monkeypatch):
    out = io.StringIO()
    display = progress.Display(stream=out, terminal=False)
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    with display:
        for done in range(10):
            display.items("reference", "math", done, 100)
            clock[0] += progress.LINE_INTERVAL_S / 4
        display.items("reference", "math", 100, 100)  # all answered; lm-eval still scoring
        clock[0] += 2 * progress.LINE_INTERVAL_S
        display.items("reference", "math", 100, 100)  # the slice's end, long after: no second line
    lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert len(lines) == 3  # 10 updates over 2.25 intervals: one line per interval, then the finished one
    assert lines[0].startswith("reference · math: 4/100 items") and "ETA" not in lines[0]  # too few to estimate
    assert lines[2].startswith("reference · math: 100/100 items")


def test_an_eta_waits_for_a_tenth_of_the_items():
    """One item of 48 done after 20 s said 'ETA 0:15:40' for a batch that then finished at once."""
    row = progress._Row(done=1, total=48, started=0.0)
    assert row.eta_s(20.0) is None
    row.done = 4
    assert row.eta_s(20.0) is None  # 4 < 4.8
    row.done = 5
    assert row.eta_s(20.0) == pytest.approx(43 / (5 / 20.0))
    assert progress._Row(done=2, total=10, started=0.0).eta_s(4.0) is None  # at least 3 items
    assert progress._Row(done=3, total=10, started=0.0).eta_s(3.0) == pytest.approx(7.0)


def test_a_stage_entered_twice_is_printed_once_and_its_time_adds_up():
    out = io.StringIO()
    display = progress.Display(stream=out, terminal=False)
    with display:
        display.stage("write")
        display.stage("write", 0.5)
        display.stage("write")
        display.stage("write", 0.25)
    lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines == ["▶ write", "✓ write 0.5 s"]
    assert display.stages["write"][1] == pytest.approx(0.75)


def test_the_live_block_shows_each_side_with_items_speed_and_eta(monkeypatch):
    display = progress.Display(stream=io.StringIO(), terminal=True)
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    display.plan(["math", "code"])
    display.stage("load")
    clock[0] += 2.0
    display.stage("load", 2.0)
    display.stage("evaluate")
    display.items("quantized", "math", 0, 18, tokens=0)
    clock[0] += 10.0
    display.items("quantized", "math", 6, 18, tokens=5000)
    display.note("reference", "code", "cached")
    from rich.console import Console

    console = Console(file=io.StringIO(), width=140, force_terminal=False)
    console.print(display.render())
    text = console.file.getvalue()
    assert "✓ load 2.0s" in text and "▶ evaluate 0:10" in text
    math_row = next(line for line in text.splitlines() if line.strip().startswith("math"))
    assert "6/18 items · 500 tok/s · ETA 0:20" in math_row  # 12 items left at 0.6 items/s
    code_row = next(line for line in text.splitlines() if line.strip().startswith("code"))
    assert "cached" in code_row


def test_a_second_process_reports_through_a_queue():
    events = queue.Queue()
    child = progress.QueueReporter(events, interval_s=3600)
    for done in range(5):
        child.items("reference", "math", done, 4 if done == 4 else 10, tokens=done)
    record = logging.LogRecord("harness", logging.INFO, __file__, 1, "[reference process] computing", None, None)
    events.put(("log", record))
    progress.end_of_events(events)
    out = io.StringIO()
    display = progress.Display(stream=out, terminal=False)
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger("harness").addHandler(handler)
    try:
        with display:
            display.follow(events)
            display.drain()
    finally:
        logging.getLogger("harness").removeHandler(handler)
    # throttled: the first count and the finished one crossed, not the three in between
    assert display.rows[("reference", "math")].done == 4
    assert [r.getMessage() for r in seen] == ["[reference process] computing"]
    assert "reference · math: 4/4 items" in out.getvalue()


@pytest.mark.parametrize("seconds, shown", [(None, "–"), (5, "0:05"), (75, "1:15"), (3725, "1:02:05")])
def test_clock(seconds, shown):
    assert progress._clock(seconds) == shown


def test_a_stage_never_breaks_across_lines_of_the_block():
    display = progress.Display(stream=io.StringIO(), terminal=True)
    for name in ("load", "reference", "quantize", "evaluate", "reference_wait", "divergence", "write", "logging"):
        display.stage(name)
        display.stage(name, 12.5)
    from rich.console import Console

    console = Console(file=io.StringIO(), width=60, force_terminal=False)
    console.print(display.render())
    header = console.file.getvalue().split("  slice")[0]
    assert all(f"✓ {name} 12.5s" in header.replace("\n", "|") for name in ("load", "reference_wait", "logging"))
    assert all(len(line) <= 60 for line in header.splitlines())
