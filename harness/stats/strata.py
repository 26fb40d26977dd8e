"""The sampling design of a slice: fixed strata, random clusters, and the variance of Δ they imply.

A slice's items come from a design with two kinds of grouping, and they call for opposite treatment:

* a **stratum** is a cell the slice enumerates on purpose (difficulty, length, depth, language,
  schema kind, a fixed set of templates). Every data set has the same strata, so differences
  *between* strata are not sampling noise: Δ̂ is the strata's Δ̂_h weighted by their share of the
  slice (n_h / n, so Δ̂ is still the plain mean of d), and its variance is the *within*-stratum one;
* a **cluster** is a group of items that share content drawn at random (a document, a problem, a
  parallel question): a new data set would draw other clusters, so items of one cluster are not
  independent, and the variance counts whole clusters.

With proportional weights Δ̂ - Δ = (1/n) Σ_i (d_i - Δ_h(i)) exactly, so each item's influence is its
residual from its stratum's mean, e_i = d_i - Δ̂_h(i), and the cluster-robust variance of Δ̂ is
``c Σ_g r_g² / n²`` with r_g = Σ_{i in g} e_i (the sandwich variance of a regression of d on stratum
indicators, clustered). Clusters need not nest in strata (a parallel question crosses languages):
the residual sums r live in a space of dimension G - K, where K is the number of connected
components of the graph joining each cluster to the strata its items fall in (K = H when clusters
nest in strata, K = 1 when every cluster crosses every stratum or there are no strata), so the
small-sample factor is c = G / (G - K) — with no strata K = 1 and this is the CR1 variance of
:func:`harness.stats.intervals.clustered_variance`. The i.i.d. variance is the within-stratum one,
``Σ_i e_i² / (n - H) / n``; their ratio, floored at 1, is the design effect: it measures clusters
only, so no slice is penalised for its strata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

__all__ = ["Design", "cluster_variance", "design", "stratum_codes"]


def stratum_codes(strata: ArrayLike | None, n: int) -> np.ndarray:
    """Integer stratum ids 0..H-1, numbered by first appearance; ``None`` is one stratum. Items
    without a label (None / NaN) share one stratum of their own: "not declared" is a cell too."""
    if strata is None:
        return np.zeros(n, dtype=np.int64)
    labels = np.asarray(strata, dtype=object)
    if labels.shape != (n,):
        raise ValueError(f"strata has shape {labels.shape}, expected ({n},): one label per item")
    codes, uniques = pd.factorize(labels)
    codes[codes < 0] = len(uniques)  # factorize numbers 0..U-1 without gaps, so no stratum is empty
    return codes.astype(np.int64)


def estimable_strata(layers: np.ndarray | None, codes: np.ndarray) -> np.ndarray | None:
    """``layers``, or None (one stratum) when the stratified design leaves no residual degree of
    freedom (G - K < 1: every random cluster alone in its stratum, as in a smoke run of a few items).
    Collapsing the strata then gives the unstratified interval, which counts the strata's differences
    as noise (wider, never narrower), instead of no interval at all."""
    if layers is None or int(layers.max()) == 0:
        return layers
    n_clusters, n_strata = int(codes.max()) + 1, int(layers.max()) + 1
    return layers if n_clusters - _components(codes, layers, n_clusters, n_strata) >= 1 else None


@dataclass(frozen=True)
class Design:
    """What the score statistic needs of a slice's design (module docstring)."""

    n_clusters: int  # G: random clusters
    n_strata: int  # H
    components: int  # K: connected components of the cluster-stratum graph
    resid_sums: np.ndarray  # r_g, one per cluster
    deff: float  # design effect of clusters, floored at 1; NaN without a residual degree of freedom

    @property
    def free(self) -> int:
        """G - K: the residual degrees of freedom of the clusters (0: no variance can be estimated)."""
        return self.n_clusters - self.components


def _components(codes: np.ndarray, strata: np.ndarray, n_clusters: int, n_strata: int) -> int:
    if n_strata == 1:
        return 1
    edges = np.unique(np.stack([codes, strata]), axis=1)
    graph = coo_matrix((np.ones(edges.shape[1]), (edges[0], n_clusters + edges[1])),
                       shape=(n_clusters + n_strata,) * 2)
    return int(connected_components(graph, directed=False)[0])


def design(diffs: np.ndarray, codes: np.ndarray, strata: np.ndarray | None = None) -> Design:
    """The design of items with differences ``diffs``, cluster ids ``codes`` (0..G-1) and stratum ids
    ``strata`` (0..H-1; None: one stratum). With one stratum every number is the unstratified one of
    :mod:`harness.stats.score` to the last bit."""
    n = diffs.size
    n_clusters = int(codes.max()) + 1
    if strata is None or int(strata.max()) == 0:
        n_strata, resid = 1, diffs - diffs.mean()
        iid = float(np.var(diffs, ddof=1)) / n if n > 1 else 0.0
    else:
        n_strata = int(strata.max()) + 1
        means = np.bincount(strata, weights=diffs, minlength=n_strata) / np.bincount(strata, minlength=n_strata)
        resid = diffs - means[strata]
        iid = float(np.sum(resid**2)) / (n - n_strata) / n if n > n_strata else 0.0
    components = _components(codes, strata if strata is not None else np.zeros(n, np.int64), n_clusters, n_strata)
    resid_sums = np.bincount(codes, weights=resid, minlength=n_clusters)
    free = n_clusters - components
    if free < 1:
        deff = math.nan
    else:
        variance = n_clusters / free * float(np.sum(resid_sums**2)) / n**2
        deff = max(1.0, variance / iid) if iid > 0 else 1.0
    return Design(n_clusters=n_clusters, n_strata=n_strata, components=components, resid_sums=resid_sums, deff=deff)


def cluster_variance(diffs: np.ndarray, codes: np.ndarray, strata: np.ndarray | None = None) -> float:
    """Cluster-robust variance of Δ̂ = mean(diffs) within strata (module docstring); NaN with G - K < 1."""
    found = design(diffs, codes, strata)
    if found.free < 1:
        return math.nan
    return found.n_clusters / found.free * float(np.sum(found.resid_sums**2)) / diffs.size**2
