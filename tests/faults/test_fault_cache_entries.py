"""Cache entries verify themselves: a manifest in COMPLETE, damaged entries moved aside, old entries upgraded."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
from pathlib import Path

import pandas as pd
import pytest

from harness.infra.cache import Cache, check_manifest, file_sha256, read_manifest


def _write_entry(cache: Cache, namespace: str = "reference", key: str = "k") -> Path:
    with cache.lock(namespace, key), cache.writing(namespace, key) as tmp:
        pd.DataFrame({"x": range(100)}).to_parquet(tmp / "records.parquet")
        (tmp / "aggregates.json").write_text('{"a": 1.0}')
    return cache.entry(namespace, key)


def test_the_complete_marker_records_size_and_sha256_of_every_file(tmp_path):
    entry = _write_entry(Cache(tmp_path))
    recorded = read_manifest(entry)
    assert set(recorded["files"]) == {"records.parquet", "aggregates.json"}
    for name, meta in recorded["files"].items():
        assert meta["size"] == (entry / name).stat().st_size
        assert meta["sha256"] == file_sha256(entry / name)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_entry_is_moved_aside_with_one_warning_and_reported_missing(tmp_path, caplog, damage):
    cache = Cache(tmp_path)
    entry = _write_entry(cache)
    target = entry / "records.parquet"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":  # same size, one byte changed: only the digest sees it
        target.write_bytes(data[:10] + bytes([data[10] ^ 0xFF]) + data[11:])
    else:
        target.unlink()
    with caplog.at_level(logging.WARNING), cache.lock("reference", "k"):
        assert not cache.usable("reference", "k")
    assert not entry.exists()
    aside = list(tmp_path.glob("reference/k.corrupt-*"))
    assert len(aside) == 1 and (aside[0] / "aggregates.json").exists()  # kept for a post-mortem
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0] and str(aside[0]) in warnings[0]
    assert "records.parquet" in warnings[0] and "\n" not in warnings[0]


def test_an_intact_entry_is_usable_and_a_check_needs_the_lock(tmp_path):
    cache = Cache(tmp_path)
    _write_entry(cache)
    with cache.lock("reference", "k"):
        assert cache.usable("reference", "k")
    with pytest.raises(RuntimeError, match="lock"):
        cache.usable("reference", "k")


def test_only_limits_the_check_to_some_files(tmp_path):
    cache = Cache(tmp_path)
    entry = _write_entry(cache)
    (entry / "records.parquet").write_bytes(b"garbage")
    with cache.lock("reference", "k"):
        assert cache.usable("reference", "k", only=lambda name: name.endswith(".json"))
        assert not cache.usable("reference", "k")


def test_an_entry_from_before_manifests_is_read_once_and_given_a_manifest(tmp_path, caplog):
    cache = Cache(tmp_path)
    entry = _write_entry(cache)
    (entry / "COMPLETE").write_text("ok\n")  # what the harness wrote before manifests
    with cache.lock("reference", "k"):
        assert cache.usable("reference", "k")
    recorded = read_manifest(entry)
    assert recorded is not None and check_manifest(entry, recorded) is None


def test_an_old_entry_that_does_not_read_back_is_moved_aside(tmp_path, caplog):
    cache = Cache(tmp_path)
    entry = _write_entry(cache)
    (entry / "COMPLETE").write_text("ok\n")
    data = (entry / "records.parquet").read_bytes()
    (entry / "records.parquet").write_bytes(data[:-20])  # the "Parquet magic bytes not found"
    with caplog.at_level(logging.WARNING), cache.lock("reference", "k"):
        assert not cache.usable("reference", "k")
    assert "records.parquet cannot be read" in caplog.text and list(tmp_path.glob("reference/k.corrupt-*"))


def _check_and_rewrite(root: str, barrier, results) -> None:
    cache = Cache(root)
    barrier.wait()
    with cache.lock("reference", "k"):
        if cache.usable("reference", "k"):
            results.put("reused")
            return
        with cache.writing("reference", "k") as tmp:
            pd.DataFrame({"x": range(100)}).to_parquet(tmp / "records.parquet")
            (tmp / "aggregates.json").write_text('{"a": 1.0}')
        results.put("recomputed")


@pytest.mark.slow
def test_two_processes_finding_one_damaged_entry_recompute_it_once(tmp_path):
    cache = Cache(tmp_path)
    entry = _write_entry(cache)
    (entry / "records.parquet").write_bytes(b"PAR1 truncated")
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    procs = [context.Process(target=_check_and_rewrite, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert sorted(results.get(timeout=5) for _ in procs) == ["recomputed", "reused"]
    assert len(list(tmp_path.glob("reference/k.corrupt-*"))) == 1
    with cache.lock("reference", "k"):
        assert cache.usable("reference", "k")
    assert json.loads((entry / "aggregates.json").read_text()) == {"a": 1.0}
