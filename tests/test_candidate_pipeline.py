"""External candidates through the whole pipeline: the harness's own int4 exported as compressed-tensors
and evaluated as `quant=external candidate.path=...` gives the same per-item results as the harness's
own fake-quant run (the export round trip), and contradictory configs fail before any work."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from omegaconf import OmegaConf

pytest.importorskip("compressed_tensors")

from harness import cli, quant
from harness.checkpoint import export
from harness.job import pipeline as run_mod  # noqa: E402
from harness.config import compose  # noqa: E402
from harness.quant import target_linears  # noqa: E402
from harness.sizing.report_quant import prepare  # noqa: E402
from tests.conftest import TINY_MATH  # noqa: E402


def _export_int4(tmp_path, cache_dir):
    cfg = OmegaConf.to_object(compose(["model=tiny_random", "quant=int4_g128", f"paths.cache_dir={cache_dir}"]))
    prepared = prepare(cfg)
    quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    targets, kept = target_linears(prepared.loaded.model, prepared.scheme)
    out = tmp_path / "exported"
    export.export(prepared.loaded.model, prepared.loaded.tokenizer, prepared.scheme, out, targets=targets, kept=kept)
    return out


@pytest.mark.slow
def test_exported_checkpoint_as_candidate_reproduces_the_harness_run(make_cfg, tmp_path, cache_dir):
    out = _export_int4(tmp_path, cache_dir)
    own = run_mod.run(make_cfg(*TINY_MATH, "quant=int4_g128"))
    external = run_mod.run(make_cfg(*TINY_MATH, "quant=external", f"candidate.path={out}"))
    assert external["scheme"] == "external:exported"
    results = {json.loads((d / "summary.json").read_text())["scheme"]: d for d in (tmp_path / "results").glob("*")}
    ours = pd.read_parquet(results["int4_g128"] / "items.parquet").sort_values("item_id", ignore_index=True)
    theirs = pd.read_parquet(results["external:exported"] / "items.parquet").sort_values("item_id", ignore_index=True)
    pd.testing.assert_frame_equal(ours, theirs)
    assert external["metrics"]["math/kl_mean"] == pytest.approx(own["metrics"]["math/kl_mean"], rel=1e-6)
    # the candidate's scheme, read from its checkpoint, lands in the quant summary
    assert external["quant"]["bits_per_weight"] == pytest.approx(4.25, abs=0.01)  # fp32 scales per 128
    assert external["quant"]["layers_quantized"] == 14


def test_contradictory_candidate_configs_fail_before_work(make_cfg, tmp_path):
    with pytest.raises(cli.UsageError, match="use quant=external"):
        run_mod.run(make_cfg(*TINY_MATH, "quant=int8", f"candidate.path={tmp_path}"))
    with pytest.raises(cli.UsageError, match="set candidate.path"):
        run_mod.run(make_cfg(*TINY_MATH, "quant=external"))
