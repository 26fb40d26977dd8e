"""The one inference of a paired comparison: a clustered score test for Δ and the interval it inverts to.

Every claim ``harness`` makes about Δ = mean(quant) - mean(ref) — its interval, the p-value of
"no change", the non-inferiority and inferiority p-values at a margin, the verdict, the gate's
pass / fail — comes from the one statistic below, so a verdict can never contradict the interval
printed beside it: for any δ0, ``p(Δ <= δ0) < a`` exactly when the lower bound of the two-sided
``1 - 2a`` interval lies above δ0.

The statistic. Split each item's difference ``d = quant - ref`` (in [-1, 1]) into its gain
``max(d, 0)`` and its loss ``max(-d, 0)``; ``B`` and ``C`` are their sums over the ``n`` items
(for 0/1 scores: the counts of wrong→right and right→wrong flips), ``S_g`` the sum of d over
cluster g (``n_g`` items, G clusters). For a hypothesised δ,

    Z(δ) = (B - C - n δ) / sqrt(max(n · V(δ) · deff,  G / (G - 1) · Σ_g (S_g - n_g δ)^2)),
    V(δ) = 2 q(δ) + δ (1 - δ),

where ``q(δ)`` is the restricted maximum-likelihood loss probability of the paired 2x2 table
under Δ = δ (closed form: the positive root of ``2n q^2 + (-B - C + (2n - B + C) δ) q - C δ (1 - δ)``),
and Z is referred to a t distribution with G - 1 degrees of freedom. With every item its own
cluster only the first variance is used (Z is then Tango's statistic exactly). Both variances are the
ones the *null hypothesis* implies, not the observed ones — that is what makes it a score test
and keeps it honest where a Wald test is not:

* ``n · V(δ)`` is Tango's paired score variance [Tango 1998, Stat Med 17:891] (without clusters
  and for 0/1 scores Z is Tango's test; at δ = 0, McNemar's asymptotic test). A slice with one
  flip in 100 items is not taken as proof that the flip rate is 1 %. ``deff`` (the design effect:
  CR1 over i.i.d. variance of the mean of d, floored at 1; 1 when all d are equal or every item is
  its own cluster) inflates it for clustering, as the Korn–Graubard effective sample size does.
* ``G/(G-1) Σ_g (S_g - n_g δ)^2`` is the cluster-robust (CR1) variance of the sum computed
  around the hypothesised Δ instead of the observed one (the "restricted" cluster-robust score
  statistic). When flips cluster in a few sources and most clusters happen to show none, the
  observed spread between clusters is small but the spread the null implies is not. With G
  clusters it caps |Z| at sqrt(G - 1), so a handful of clusters cannot show a small margin —
  correctly: five clusters cannot tell "no flips" from "flips concentrated in a source not drawn".

Composite hypotheses. "Non-inferior" rejects every Δ <= -m, not only Δ = -m, so its p-value is
the largest over that half-line: the statistic is ``min_{δ <= -m} Z(δ)`` (``z_lower``; and
``max_{δ >= δ0} Z(δ)``, ``z_upper``, for "worse than δ0"), taken over a 1,025-point grid of
[-1, 1] and the point itself. Z is not monotone in δ when the cluster-robust variance is the
larger one; the composite statistics are, so the interval's bounds (their crossings of ±t,
found by bisection) and the p-values say the same thing.

Partial credit. With fractional ``B`` and ``C`` the same V(δ) is an upper bound of Var(d) for
any d in [-1, 1] with those gain/loss means (gain² <= gain, loss² <= loss, gain · loss = 0), so
the test stays valid and is conservative in proportion to how far scores sit from 0/1.

The operating characteristics (false-pass at Δ = -m, power at Δ = 0 and -m/2) over sizes,
cluster structures, accuracies, flip patterns and partial credit are measured by
``benchmarks/bench_gate_oc.py``; its table is in the README.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from harness.stats.intervals import clustered_variance

__all__ = ["ScoreTest", "cluster_moments", "design_effect", "restricted_loss", "score_interval", "score_test",
           "score_z", "z_lower", "z_upper"]

_BISECTIONS = 48  # interval bounds to ~1e-14 of [-1, 1]: far below any printed digit
_GRID = np.linspace(-1.0, 1.0, 1025)  # where the composite statistics look for a lower / higher Z


def restricted_loss(delta, gains, losses, n):
    """Restricted MLE of the loss probability of a paired 2x2 table under Δ = ``delta`` (arrays broadcast)."""
    delta, gains, losses, n = (np.asarray(x, dtype=float) for x in (delta, gains, losses, n))
    b = -gains - losses + (2 * n - gains + losses) * delta
    c = -losses * delta * (1 - delta)
    root = (-b + np.sqrt(np.maximum(b * b - 8 * n * c, 0.0))) / (4 * n)
    return np.clip(root, np.maximum(0.0, -delta), np.minimum(1.0, (1 - delta) / 2))


def score_z(delta, gains, losses, n, clusters=None, s2=None, sn=None, nn=None, deff=1.0):
    """Z(δ) of the module docstring (arrays broadcast); 0 where numerator and variance both vanish.

    ``clusters``, ``s2`` = Σ S_g², ``sn`` = Σ n_g S_g, ``nn`` = Σ n_g² give the cluster-robust
    null variance ``G/(G-1) (s2 - 2 δ sn + δ² nn)``; without them every item is its own cluster
    and they follow from ``gains``/``losses`` for 0/1 scores only, so pass them for partial credit.
    """
    delta, gains, losses, n = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (delta, gains, losses, n)))
    table = n * (2 * restricted_loss(delta, gains, losses, n) + delta * (1 - delta)) * np.asarray(deff, dtype=float)
    if clusters is None:  # singletons with 0/1 differences: Σ S_g² = B + C, Σ n_g S_g = B - C, Σ n_g² = n
        clusters, s2, sn, nn = n, gains + losses, gains - losses, n
    clusters, s2, sn, nn = (np.asarray(x, dtype=float) for x in (clusters, s2, sn, nn))
    with np.errstate(divide="ignore", invalid="ignore"):
        robust = np.where((clusters > 1) & (clusters < n),  # singletons: Tango's statistic alone
                          clusters / (clusters - 1) * (s2 - 2 * delta * sn + delta * delta * nn), 0.0)
    variance = np.maximum(np.maximum(table, robust), 0.0)
    numerator = gains - losses - n * delta
    scale = np.sqrt(variance)
    tiny = np.abs(numerator) <= 1e-12 * np.maximum(n, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(scale > 0, numerator / np.where(scale > 0, scale, 1.0),
                     np.where(tiny, 0.0, np.copysign(np.inf, numerator)))
    return z


def _grid_z(gains, losses, n, clusters, s2, sn, nn, deff) -> np.ndarray:
    """Z on ``_GRID`` for each table: shape (tables, grid points)."""
    columns = [np.atleast_1d(np.asarray(x, dtype=float))[:, None] if x is not None else None
               for x in (gains, losses, n, clusters, s2, sn, nn, deff)]
    return score_z(_GRID[None, :], *columns)


def z_lower(delta, gains, losses, n, clusters=None, s2=None, sn=None, nn=None, deff=1.0):
    """Statistic of the composite H0 Δ <= ``delta``: min of Z over [-1, delta] (``_GRID`` points and delta)."""
    grid = _grid_z(gains, losses, n, clusters, s2, sn, nn, deff)
    delta = np.atleast_1d(np.asarray(delta, dtype=float))
    masked = np.where(_GRID[None, :] <= delta[:, None], grid, np.inf)
    point = np.atleast_1d(score_z(delta, gains, losses, n, clusters, s2, sn, nn, deff))
    return np.minimum(masked.min(axis=1), point)


def z_upper(delta, gains, losses, n, clusters=None, s2=None, sn=None, nn=None, deff=1.0):
    """Statistic of the composite H0 Δ >= ``delta``: max of Z over [delta, 1]."""
    grid = _grid_z(gains, losses, n, clusters, s2, sn, nn, deff)
    delta = np.atleast_1d(np.asarray(delta, dtype=float))
    masked = np.where(_GRID[None, :] >= delta[:, None], grid, -np.inf)
    point = np.atleast_1d(score_z(delta, gains, losses, n, clusters, s2, sn, nn, deff))
    return np.maximum(masked.max(axis=1), point)


def _bound(estimate, critical, side, z_of):
    """Lower (side -1) or upper (+1) bound: the δ where the composite statistic crosses ±critical,
    by bisection between the estimate and the end of [-1, 1] (the composite statistics are monotone)."""
    inner = np.atleast_1d(np.asarray(estimate, dtype=float)).copy()
    outer = np.full_like(inner, float(side))
    target = -side * np.asarray(critical, dtype=float)
    for _ in range(_BISECTIONS):
        middle = (inner + outer) / 2
        beyond = (z_of(middle) - target) * side < 0  # past the bound
        outer = np.where(beyond, middle, outer)
        inner = np.where(beyond, inner, middle)
    return (inner + outer) / 2


def score_interval(gains, losses, n, critical, clusters=None, s2=None, sn=None, nn=None, deff=1.0):
    """Two-sided interval: [inf{δ: z_lower(δ) <= c}, sup{δ: z_upper(δ) >= -c}], vectorised over tables."""
    args = [np.atleast_1d(np.asarray(x, dtype=float)) if x is not None else None
            for x in (gains, losses, n, clusters, s2, sn, nn, deff)]
    estimate = (args[0] - args[1]) / args[2]
    return (_bound(estimate, critical, -1, lambda d: z_lower(d, *args)),
            _bound(estimate, critical, +1, lambda d: z_upper(d, *args)))


def cluster_moments(codes: np.ndarray, diffs: np.ndarray) -> tuple[int, float, float, float]:
    """(G, Σ S_g², Σ n_g S_g, Σ n_g²) of ``diffs`` over clusters ``codes`` (0..G-1)."""
    n_clusters = int(codes.max()) + 1
    sums = np.bincount(codes, weights=diffs, minlength=n_clusters)
    sizes = np.bincount(codes, minlength=n_clusters).astype(float)
    return n_clusters, float(sums @ sums), float(sizes @ sums), float(sizes @ sizes)


def design_effect(codes: np.ndarray, diffs: np.ndarray) -> float:
    """CR1 variance of mean(diffs) over its i.i.d. variance, floored at 1; NaN with < 2 clusters."""
    variance = clustered_variance(codes, diffs)
    if math.isnan(variance):
        return math.nan
    iid = float(np.var(diffs, ddof=1)) / diffs.size if diffs.size > 1 else 0.0
    return max(1.0, variance / iid) if iid > 0 else 1.0


@dataclass(frozen=True)
class ScoreTest:
    """The data of one comparison reduced to what the score statistic needs; every p-value and bound."""

    n: int
    gains: float  # B: sum of max(d, 0)
    losses: float  # C: sum of max(-d, 0)
    n_clusters: int  # G
    sum_sq: float  # Σ_g S_g²
    sum_size: float  # Σ_g n_g S_g
    size_sq: float  # Σ_g n_g²
    deff: float  # design effect: inflates the paired-table variance

    @property
    def dof(self) -> float:
        return self.n_clusters - 1

    @property
    def estimate(self) -> float:
        return (self.gains - self.losses) / self.n

    def _moments(self) -> tuple[float, float, float, float, float]:
        return self.n_clusters, self.sum_sq, self.sum_size, self.size_sq, self.deff

    def z(self, delta: float) -> float:
        return float(score_z(delta, self.gains, self.losses, self.n, *self._moments()))

    def p_greater(self, delta: float) -> float:
        """One-sided p of the composite H0 Δ <= delta (small: Δ > delta shown). NaN with < 2 clusters."""
        if self.n_clusters < 2:
            return math.nan
        return float(sps.t.sf(z_lower(delta, self.gains, self.losses, self.n, *self._moments())[0], self.dof))

    def p_less(self, delta: float) -> float:
        """One-sided p of the composite H0 Δ >= delta (small: Δ < delta shown)."""
        if self.n_clusters < 2:
            return math.nan
        return float(sps.t.cdf(z_upper(delta, self.gains, self.losses, self.n, *self._moments())[0], self.dof))

    def p_two_sided(self, delta: float = 0.0) -> float:
        if self.n_clusters < 2:
            return math.nan
        return min(1.0, 2 * min(self.p_greater(delta), self.p_less(delta)))

    def interval(self, level: float) -> tuple[float, float]:
        """Two-sided ``level`` interval (each side (1 - level) / 2); (NaN, NaN) with < 2 clusters."""
        if self.n_clusters < 2:
            return math.nan, math.nan
        critical = float(sps.t.ppf(1 - (1 - level) / 2, self.dof))
        low, high = score_interval(self.gains, self.losses, self.n, critical, *self._moments())
        return float(low[0]), float(high[0])


def score_test(diffs: np.ndarray, codes: np.ndarray) -> ScoreTest:
    """The score test of the paired differences ``diffs`` (in [-1, 1]) with cluster ids ``codes`` (0..G-1)."""
    n_clusters, sum_sq, sum_size, size_sq = cluster_moments(codes, diffs)
    return ScoreTest(n=int(diffs.size), gains=float(np.clip(diffs, 0, None).sum()),
                     losses=float(np.clip(-diffs, 0, None).sum()), n_clusters=n_clusters, sum_sq=sum_sq,
                     sum_size=sum_size, size_sq=size_sq, deff=design_effect(codes, diffs))
