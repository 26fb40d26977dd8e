"""CUDA out-of-memory during evaluation: the batch is run again in halves, down to one row (injected on the CPU)."""
from __future__ import annotations

import logging

import pandas as pd
import pytest
import torch

from harness.evaluation import evaluate
from harness.job import identity
from harness.config import to_config
from harness.models import loading as models
from harness.evaluation.generation import halve_on_oom
from harness.evaluation.slices import resolve
from tests.conftest import TINY_MATH


def test_halving_splits_only_what_does_not_fit_and_keeps_row_order(caplog):
    calls = []

    def run(start: int, stop: int) -> list[int]:
        calls.append((start, stop))
        if stop - start > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return list(range(start, stop))

    with caplog.at_level(logging.WARNING, logger="harness"):
        out = halve_on_oom(run, 7, lambda parts: [x for part in parts for x in part], what="rows")
    assert out == list(range(7))
    assert calls == [(0, 7), (0, 4), (0, 2), (2, 4), (4, 7), (4, 6), (6, 7)]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["CUDA out of memory on a batch of 7 rows; retrying it as batches of 4 and 3",
                        "CUDA out of memory on a batch of 4 rows; retrying it as batches of 2 and 2",
                        "CUDA out of memory on a batch of 3 rows; retrying it as batches of 2 and 1"]


def test_a_single_row_that_does_not_fit_re_raises(caplog):
    def run(start: int, stop: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        halve_on_oom(run, 2, list, what="rows")
    assert "single rows" in caplog.text and "eval.max_length" in caplog.text


def test_other_errors_are_not_retried():
    calls = []

    def run(start: int, stop: int) -> None:
        calls.append((start, stop))
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        halve_on_oom(run, 8, list, what="rows")
    assert calls == [(0, 8)]


def _records(cfg, loaded, slice_):
    settings = identity.eval_settings(cfg, None)
    lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
    records, _ = evaluate.evaluate_slice(lm, slice_, settings)
    return records


@pytest.mark.slow
def test_an_evaluation_that_runs_out_of_memory_gives_the_undisturbed_records(make_cfg, caplog):
    """Any forward of more than two rows fails as a GPU out of memory would; the records stay the same."""
    cfg = to_config(make_cfg(*TINY_MATH, "quant=none", "eval.batch_size=8"))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    slice_ = resolve(cfg.slices)[0]
    undisturbed = _records(cfg, loaded, slice_)
    failures = []

    def out_of_memory(module, args):
        if args[0].shape[0] > 2:
            failures.append(args[0].shape[0])
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected: batch of {args[0].shape[0]})")

    handle = loaded.model.get_input_embeddings().register_forward_pre_hook(out_of_memory)
    try:
        with caplog.at_level(logging.WARNING, logger="harness"):
            disturbed = _records(cfg, loaded, slice_)
    finally:
        handle.remove()
    assert failures, "the injection never fired: no batch of more than two rows"
    halvings = [r.getMessage() for r in caplog.records if "CUDA out of memory on a batch" in r.getMessage()]
    assert any("generation requests" in m for m in halvings)
    assert any("choices" in m or "log-likelihood requests" in m for m in halvings)
    pd.testing.assert_frame_equal(disturbed, undisturbed)
