"""A served candidate's bits per weight: what its checkpoint stores, never the 16 bits of a report with
no layers. Counted by hand here from the reference's linear shapes."""
from __future__ import annotations

import math

import pytest

from harness.config import CandidateConfig
from harness.engines.served import ServedCandidate
from harness.results.report import bits_phrase
from tests.tiny_models import tiny_llama


def _served(tmp_path, **params) -> ServedCandidate:
    candidate = ServedCandidate(CandidateConfig(endpoint="http://127.0.0.1:9"), tmp_path)  # nothing is started
    candidate.params.update(params)
    return candidate


def test_a_served_checkpoint_counts_its_stored_bits_on_the_reference_linears(tmp_path):
    model = tiny_llama()
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if hasattr(m, "out_features") and m is not head]
    linear_params = sum(m.weight.numel() for m in linears)
    total = sum(p.numel() for p in model.parameters())
    report = _served(tmp_path, **{"candidate.bits_per_weight": 8.05}).quant_report(model)
    summary = report.summary()
    assert summary["bits_per_weight"] == pytest.approx(8.05)
    assert report.weight_bits == pytest.approx(linear_params * 8.05 + (total - linear_params) * 16)
    assert summary["layers_quantized"] == len(linears)
    assert math.isnan(summary["sqnr_db_mean"])  # no weights seen: no SQNR, and not "exact" (inf)
    assert bits_phrase(summary) == "8.050 bits/weight"


def test_a_kept_linear_of_the_served_checkpoint_counts_at_16_bits(tmp_path):
    model = tiny_llama()
    kept = "model.layers.0.mlp.down_proj"
    kept_params = dict(model.named_modules())[kept].weight.numel()
    head = model.get_output_embeddings()
    linear_params = sum(m.weight.numel() for m in model.modules() if hasattr(m, "out_features") and m is not head)
    report = _served(tmp_path, **{"candidate.bits_per_weight": 4.25, "candidate.kept": kept}).quant_report(model)
    expected = ((linear_params - kept_params) * 4.25 + kept_params * 16) / linear_params
    assert report.summary()["bits_per_weight"] == pytest.approx(expected)


def test_an_endpoint_without_a_local_checkpoint_has_no_bits_rather_than_16(tmp_path):
    report = _served(tmp_path).quant_report(tiny_llama())
    assert report.bits_known is False
    assert bits_phrase({}) == "bits/weight not known: no local checkpoint"
