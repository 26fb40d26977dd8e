"""Paired statistics for comparing a quantized model with its reference on the same items.

``paired``: the per-comparison result (``paired_compare``, ``compare_frame``); ``score``: the one
inference every claim about Δ comes from (a stratified, clustered paired score test and its interval);
``strata``: a slice's sampling design (fixed strata, random clusters inside or across them);
``verdict``: labels read off that interval; ``sequential``: the anytime-valid (betting
confidence sequence) verdict of a slice scored in rounds; ``group_sequential``: the same verdict from
the score test at the rounds' looks with an α-spending function; ``intervals``: Wilson / Newcombe and the clustered
variance; ``multiple``: Holm / BH adjustment.
"""

from harness.stats.group_sequential import spending_boundaries, spending_test
from harness.stats.multiple import adjust_pvalues
from harness.stats.paired import (
    BOOTSTRAP_MIN_CLUSTERS,
    BOOTSTRAP_MIN_EVENT_CLUSTERS,
    MIN_CLUSTERS,
    RIGHT_THRESHOLD,
    PairedResult,
    compare_frame,
    flip_table,
    noninferiority_items,
    paired_compare,
)
from harness.stats.score import ScoreTest, score_test
from harness.stats.sequential import SequentialResult, cluster_order, cs_bounds, rounds, sequential_test
from harness.stats.strata import stratum_codes

__all__ = [
    "BOOTSTRAP_MIN_CLUSTERS",
    "BOOTSTRAP_MIN_EVENT_CLUSTERS",
    "MIN_CLUSTERS",
    "RIGHT_THRESHOLD",
    "PairedResult",
    "ScoreTest",
    "SequentialResult",
    "adjust_pvalues",
    "cluster_order",
    "compare_frame",
    "cs_bounds",
    "flip_table",
    "noninferiority_items",
    "paired_compare",
    "rounds",
    "score_test",
    "sequential_test",
    "spending_boundaries",
    "spending_test",
    "stratum_codes",
]
