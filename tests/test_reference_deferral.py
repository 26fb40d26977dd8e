"""reference_unless_busy / deferred_references in one process: a lease owned by another node defers."""
from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from harness.models import loading as models
from harness.infra.cache import Cache
from harness.job.identity import ReferenceSpec, reference_key
from harness.config import to_config
from harness.job.reference import compute_reference, deferred_references, reference_unless_busy
from harness.evaluation.slices import resolve
from tests.test_sweeps import TINY


@pytest.mark.slow
def test_a_live_foreign_lease_defers_and_a_vanished_one_is_computed_from_a_reloaded_model(make_cfg, caplog):
    cfg = to_config(make_cfg(*TINY, "quant=none"))
    spec = ReferenceSpec.of(cfg)
    cache = Cache(cfg.paths.cache_dir)
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    [slice_] = resolve(cfg.slices)
    lease = cache.root / "reference" / f"{reference_key(loaded, slice_, spec)}.lease"
    lease.parent.mkdir(parents=True, exist_ok=True)
    lease.write_text(json.dumps({"host": "another-node", "pid": 1, "started": time.time(), "token": "x"}))
    started = time.monotonic()
    assert reference_unless_busy(loaded, slice_, spec, cache) is None  # a live owner elsewhere: no waiting
    assert time.monotonic() - started < 5 and lease.exists()
    with torch.no_grad():  # "quantize" in place: the reference must not come from this model
        for parameter in loaded.model.parameters():
            parameter.mul_(0.5)
    lease.unlink()  # the other job is gone without writing the entry
    with caplog.at_level(logging.WARNING, logger="harness"):
        [reference] = deferred_references(loaded, [slice_], spec, cache, cfg.model).values()
    assert any("ended without finishing it" in r.getMessage() for r in caplog.records)
    # independent: the reference of a freshly loaded, unquantized model on a cache of its own
    fresh = models.load(cfg.model, cfg.paths.cache_dir)
    other = compute_reference(fresh, slice_, spec, Cache(cache.root.parent / "other_cache"))
    columns = ["item_id", "response", "correct"]
    assert reference.records[columns].equals(other.records[columns])
    for mine, theirs in zip(reference.texts, other.texts):
        assert torch.equal(mine.input_ids, theirs.input_ids) and torch.equal(mine.targets()[0], theirs.targets()[0])
    assert reference_unless_busy(loaded, slice_, spec, cache).cached  # now complete: read, not deferred
