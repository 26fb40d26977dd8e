"""The reference in a second process on a CPU: the same results as computing it in the job."""
from __future__ import annotations

import pandas as pd
import pytest

from harness.job import background_reference
from harness.job import identity
from harness.config import to_config
from harness.models import loading as models
from harness.job.pipeline import run

TINY = ["model=tiny_random", "slices=[math]", "slices.math.n_items=9", "slices.math.divergence_texts=2",
        "slices.math.tasks=[harness_math_gen,harness_math_mc]", "quant=int4_g128", "tracking.enabled=false"]


@pytest.mark.slow
def test_a_split_job_matches_a_serial_one(make_cfg, tmp_path):
    # threads=2 splits into 1 + 1, the kernels of a serial run with 1 thread (other thread counts sum in
    # another order): so records must be equal and metrics equal to float rounding.
    split = run(make_cfg(*TINY, "runtime.threads=2", "runtime.reference_process=true",
                         f"paths.results_dir={tmp_path / 'split'}"))
    assert split["runtime"]["reference_process"] == ["math"]
    assert split["reference_deferred"] == ["math"]
    serial = run(make_cfg(*TINY, "runtime.threads=1", "runtime.reference_process=false",
                          f"paths.results_dir={tmp_path / 'serial'}", f"paths.cache_dir={tmp_path / 'cache2'}"))
    assert serial["runtime"]["reference_process"] == []
    items = {name: pd.read_parquet(next((tmp_path / name).glob("*/items.parquet"))) for name in ("split", "serial")}
    pd.testing.assert_frame_equal(items["split"], items["serial"])
    for key in ("math/acc_ref", "math/acc_quant", "math/flips_right_to_wrong"):
        assert split["metrics"][key] == serial["metrics"][key], key
    assert split["metrics"]["math/kl_mean"] == pytest.approx(serial["metrics"]["math/kl_mean"], rel=1e-3)


@pytest.mark.slow
def test_a_null_scheme_split_is_exactly_its_reference(make_cfg, tmp_path):
    # The divergence stage runs its forwards with the child's thread count and both heads with all of this
    # process's threads: the quantized side's states and logits must still equal the reference's bit for bit.
    run(make_cfg(*TINY, "quant=none", "runtime.threads=2", "runtime.reference_process=true",
                 f"paths.results_dir={tmp_path}"))
    tokens = pd.read_parquet(next(tmp_path.glob("*/tokens.parquet")))
    assert len(tokens) > 100
    assert (tokens["kl"] == 0).all() and (tokens["kl_reverse"] == 0).all()
    assert (tokens["nll_ref"] == tokens["nll_quant"]).all()
    assert (tokens["top1_ref"] == tokens["top1_quant"]).all()


@pytest.mark.slow
def test_a_cached_reference_starts_no_process(make_cfg, tmp_path):
    run(make_cfg(*TINY, "runtime.threads=1"))
    again = run(make_cfg(*TINY, "runtime.threads=2", "runtime.reference_process=true", "quant=int8"))
    assert again["runtime"]["reference_process"] == []
    assert again["reference_deferred"] == []


@pytest.mark.slow
def test_when_to_split(make_cfg):
    cfg = to_config(make_cfg(*TINY))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    spec = identity.ReferenceSpec.of(cfg)
    assert background_reference.wanted(spec, loaded, 2, 1)[0]  # auto: CPU, 2 threads, a small model
    assert not background_reference.wanted(spec, loaded, 1, 1)[0]
    assert not background_reference.wanted(spec, loaded, 2, 0)[0]
    off = identity.ReferenceSpec.of(to_config(make_cfg(*TINY, "runtime.reference_process=false")))
    assert background_reference.wanted(off, loaded, 2, 1) == (False, "runtime.reference_process=false")
    gpu = identity.ReferenceSpec.of(to_config(make_cfg(*TINY, "model.device=auto")))
    assert background_reference.wanted(gpu, loaded, 8, 1) == (False, "not a CPU job")


def test_collecting_the_child_gives_this_process_every_thread_back():
    # start() leaves this process its share of the threads; once the child is collected the divergence stage runs
    # on all of them, whether or not a late reference was computed here first (which also resets the count)
    import queue
    import types

    import torch

    from harness.job import stage_meter

    done = queue.Queue()
    done.put({})
    child = types.SimpleNamespace(join=lambda timeout=None: None, is_alive=lambda: False, pid=0)
    background = background_reference.Background(child, ["math"], (1, 1), done)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        background_reference.collect(background, stage_meter.StageMeter())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
