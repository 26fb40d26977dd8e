"""The one inference of a paired comparison: a clustered score test for Δ and the interval it inverts to.

Every claim ``harness`` makes about Δ = mean(quant) - mean(ref) — its interval, the p-value of
"no change", the non-inferiority and inferiority p-values at a margin, the verdict, the gate's
pass / fail — comes from the one statistic below, so a verdict can never contradict the interval
printed beside it: for any δ0, ``p(Δ <= δ0) < a`` exactly when the lower bound of the two-sided
``1 - 2a`` interval lies above δ0 (Z falls monotonically in δ, so each bound is one root).

The statistic. Split each item's difference ``d = quant - ref`` (in [-1, 1]) into its gain
``max(d, 0)`` and its loss ``max(-d, 0)``; ``B`` and ``C`` are their sums over the ``n`` items
(for 0/1 scores: the counts of wrong→right and right→wrong flips). For a hypothesised δ,

    Z(δ) = (B - C - n δ) / sqrt(n · V(δ) · deff),   V(δ) = 2 q(δ) + δ (1 - δ),

where ``q(δ)`` is the restricted maximum-likelihood loss probability of the paired 2x2 table
under Δ = δ (closed form: the positive root of ``2n q^2 + (-B - C + (2n - B + C) δ) q - C δ (1 - δ)``),
and Z is referred to a t distribution with G - 1 degrees of freedom (G clusters; t_{n-1} ≈ normal
when every item is its own cluster; fewer when the clusters inflate the variance, below). Without clusters and for 0/1 scores this is Tango's score
test for a paired difference [Tango 1998, Stat Med 17:891]; at δ = 0 it is McNemar's asymptotic
test. It is a *score* test: the variance is the one the null hypothesis implies, not the
observed one, so a slice with one flip in 100 items is not taken as proof that the flip rate is
1 % (the Wald t test used before did, and passed at the margin up to twice as often as α).

Clusters. ``deff`` is the design effect of the mean of d: the CR1 cluster-robust variance over
the i.i.d. one, floored at 1 (1 when all d are equal or every item is its own cluster); with the
t_{G-1} reference this is the Korn–Graubard effective sample size [Korn & Graubard 1998]
applied to a score statistic. It is estimated from the data, so it is only as good as the
clusters let it be. When the clusters inflate the variance (deff > 1), the variance is an
estimate from the clusters' residual sums r_g = S_g - n_g Δ̂, and it is only as certain as the
number of clusters it really rests on: Z is then referred to t with the Satterthwaite
effective number of clusters ``ν = (Σ r_g²)² / Σ r_g⁴`` (at most G - 1, at least 1) degrees of
freedom instead of G - 1 [the Welch–Satterthwaite approximation applied to the sum of the
clusters' squared residuals; the "effective number of clusters" idea of Carter, Schnepel &
Steigerwald 2017]. With flips concentrated in two of ten clusters ν is about 2, not 9. Before
this (t on G - 1), ten clusters with ICC 0.05 passed at the margin in up to 13 % of data sets
and twenty in up to 10 %; with ν they stay within Monte-Carlo error of α from twenty clusters
up (``benchmarks/bench_gate_oc.py``; README: the measured rates, and where they still exceed α
— a handful of clusters whose flips are very unequal, where no estimate from those clusters
can see the flips a cluster that was not drawn would have had). With deff = 1 (every item its
own cluster, or clusters that do not inflate the variance) the variance is the null one and
nothing is estimated: t on G - 1, as before.

Strata (``harness.stats.strata``). A stratum is a cell the slice enumerates on purpose
(difficulty, length, template of a fixed set), a cluster a group of items drawn at random together.
With strata h = 1..H of sizes n_h (tables B_h, C_h) the estimate is unchanged — strata weighted by
their share n_h / n make Σ w_h Δ̂_h the plain mean — and the null variance is the within-stratum one:

    Z(δ) = (B - C - n δ) / sqrt(c · deff · Σ_h n_h V_h(δ_h)),   δ_h = Δ̂_h + (δ - Δ̂),   c = (n - 1) / (n - H),

each stratum's Tango variance V_h at its own Δ̂_h moved by the hypothesised shift of the whole slice
(clipped to [-1, 1]): at δ = Δ̂ it is each stratum's observed variance, and away from Δ̂ it grows
as Tango's does, so a stratum without a flip still carries the variance the null implies. Since each
V_h satisfies Tango's monotonicity in its own shift, Z still falls monotonically in δ and every
p-value still reads the one interval. ``c`` keeps the variance's small-sample bias what it is with
one stratum (the MLE variance divides by n_h, not n_h - 1). ``deff`` and the degrees of freedom are
the clusters' alone: residuals from each stratum's mean, summed by cluster (clusters may cross
strata), CR1 with G - K residual degrees of freedom (K: connected components of the cluster-stratum
graph; K = 1 without strata), over the within-stratum i.i.d. variance; t on G - K, or the
Satterthwaite number of the residual sums when deff > 1. With one stratum all of this is the
statistic above, to the last bit. Chosen by measurement (``benchmarks/bench_gate_oc.py --strata``,
``docs/explanation/strata.md``) over the null variance at a common δ_h = δ (same false-pass rate,
less power), the same without ``c`` (more designs above α) and the observed within-stratum (Wald)
variance (false pass up to 4x α).

Partial credit. With fractional ``B`` and ``C`` the same V(δ) is an upper bound of Var(d) for
any d in [-1, 1] with those gain/loss means (gain² <= gain, loss² <= loss, gain · loss = 0), so
the test stays valid and is conservative in proportion to how far scores sit from 0/1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from harness.stats.intervals import clustered_variance
from harness.stats.strata import design

__all__ = ["ScoreTest", "design_effect", "effective_clusters", "restricted_loss", "score_dof", "score_interval",
           "score_test", "score_z", "stratified_interval", "stratified_z"]

_BISECTIONS = 56  # interval bounds to ~3e-17 of [-1, 1]: far below any printed digit


def restricted_loss(delta, gains, losses, n):
    """Restricted MLE of the loss probability of a paired 2x2 table under Δ = ``delta`` (arrays broadcast)."""
    delta, gains, losses, n = (np.asarray(x, dtype=float) for x in (delta, gains, losses, n))
    b = -gains - losses + (2 * n - gains + losses) * delta
    c = -losses * delta * (1 - delta)
    root = (-b + np.sqrt(np.maximum(b * b - 8 * n * c, 0.0))) / (4 * n)
    return np.clip(root, np.maximum(0.0, -delta), np.minimum(1.0, (1 - delta) / 2))


def score_z(delta, gains, losses, n, deff=1.0):
    """Z(δ) of the module docstring (arrays broadcast); 0 where numerator and variance both vanish."""
    delta, gains, losses, n, deff = np.broadcast_arrays(*(np.asarray(x, dtype=float)
                                                          for x in (delta, gains, losses, n, deff)))
    variance = n * (2 * restricted_loss(delta, gains, losses, n) + delta * (1 - delta)) * deff
    return _ratio(gains - losses - n * delta, variance, n)


def _ratio(numerator, variance, n):
    scale = np.sqrt(np.maximum(variance, 0.0))
    tiny = np.abs(numerator) <= 1e-12 * np.maximum(n, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale > 0, numerator / np.where(scale > 0, scale, 1.0),
                        np.where(tiny, 0.0, np.copysign(np.inf, numerator)))


def stratified_z(delta, gains, losses, sizes, deff=1.0):
    """Z(δ) of strata (module docstring, "Strata"): ``gains``, ``losses``, ``sizes`` hold one stratum per
    entry of their last axis; ``delta`` and ``deff`` broadcast against the others. One stratum: ``score_z``."""
    gains, losses, sizes = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (gains, losses, sizes)))
    n = sizes.sum(axis=-1)
    total = gains.sum(axis=-1) - losses.sum(axis=-1)
    delta = np.asarray(delta, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        shift = np.where(sizes > 0, (gains - losses) / np.where(sizes > 0, sizes, 1.0), 0.0) - (total / n)[..., None]
    strata = np.clip(delta[..., None] + shift, -1.0, 1.0)  # δ_h = Δ̂_h + (δ - Δ̂); one stratum: δ itself
    per = sizes * (2 * restricted_loss(strata, gains, losses, np.maximum(sizes, 1e-300)) + strata * (1 - strata))
    count = np.sum(sizes > 0, axis=-1)
    correction = np.where(n > count, (n - 1) / np.maximum(n - count, 1e-300), 1.0)  # 1 with one stratum
    variance = per.sum(axis=-1) * correction * np.asarray(deff, dtype=float)
    return _ratio(total - n * delta, variance, n)


def _bound(estimate, z, critical, side):
    """The δ where ``z(δ)`` = +critical (side -1: lower bound) or -critical (side +1: upper), by bisection
    between the estimate and the end of [-1, 1] (Z falls as δ rises)."""
    inner = np.asarray(estimate, dtype=float).copy()
    outer = np.full_like(inner, float(side))
    target = -side * np.asarray(critical, dtype=float)
    for _ in range(_BISECTIONS):
        middle = (inner + outer) / 2
        beyond = (z(middle) - target) * side < 0  # past the bound
        outer = np.where(beyond, middle, outer)
        inner = np.where(beyond, inner, middle)
    return (inner + outer) / 2


def score_interval(gains, losses, n, critical, deff=1.0):
    """Two-sided interval {δ : |Z(δ)| <= critical}, vectorised over arrays of tables."""
    estimate = (np.asarray(gains, float) - np.asarray(losses, float)) / np.asarray(n, float)

    def z(delta):
        return score_z(delta, gains, losses, n, deff)

    return _bound(estimate, z, critical, -1), _bound(estimate, z, critical, +1)


def stratified_interval(gains, losses, sizes, critical, deff=1.0):
    """Two-sided interval {δ : |Z(δ)| <= critical} of stratified tables (last axis: strata)."""
    gains, losses, sizes = (np.asarray(x, dtype=float) for x in (gains, losses, sizes))
    estimate = (gains.sum(axis=-1) - losses.sum(axis=-1)) / sizes.sum(axis=-1)

    def z(delta):
        return stratified_z(delta, gains, losses, sizes, deff)

    return _bound(estimate, z, critical, -1), _bound(estimate, z, critical, +1)


def design_effect(codes: np.ndarray, diffs: np.ndarray) -> float:
    """CR1 variance of mean(diffs) over its i.i.d. variance, floored at 1; NaN with < 2 clusters."""
    variance = clustered_variance(codes, diffs)
    if math.isnan(variance):
        return math.nan
    iid = float(np.var(diffs, ddof=1)) / diffs.size if diffs.size > 1 else 0.0
    return max(1.0, variance / iid) if iid > 0 else 1.0


def effective_clusters(resid_sums) -> np.ndarray:
    """Satterthwaite effective number of clusters ``(Σ r²)² / Σ r⁴`` of residual sums ``r`` (last axis),
    as degrees of freedom: clipped to [1, G - 1]; G - 1 where every residual is 0."""
    resid_sums = np.asarray(resid_sums, dtype=float)
    clusters = resid_sums.shape[-1]
    square = np.sum(resid_sums**2, axis=-1)
    fourth = np.sum(resid_sums**4, axis=-1)
    scale = np.max(np.abs(resid_sums), axis=-1) if clusters else 0.0
    zero = fourth <= (1e-12 * np.maximum(scale, 1e-300)) ** 4  # rounding residue of cancelling flips
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(zero, clusters - 1, square**2 / np.where(zero, 1.0, fourth))
    return np.clip(ratio, 1.0, max(clusters - 1, 1))


def score_dof(codes: np.ndarray, diffs: np.ndarray, deff: float) -> float:
    """Degrees of freedom of the score test's t reference (module docstring): G - 1 with deff = 1,
    the effective number of clusters of the residual sums when deff > 1."""
    n_clusters = int(codes.max()) + 1
    if n_clusters < 2 or not deff > 1 + 1e-9:  # 1 up to rounding: partial credit without clusters gives 1 + 2e-16
        return float(n_clusters - 1)
    resid_sums = np.bincount(codes, weights=diffs - diffs.mean(), minlength=n_clusters)
    return float(effective_clusters(resid_sums))


@dataclass(frozen=True)
class ScoreTest:
    """The data of one comparison reduced to what the score statistic needs; every p-value and bound."""

    n: int
    gains: float  # B: sum of max(d, 0)
    losses: float  # C: sum of max(-d, 0)
    deff: float  # design effect of the clusters (module docstring)
    n_clusters: int  # G: random clusters (strata are not counted)
    dof: float  # of the t reference: G - K, or the effective number of clusters when deff > 1
    # Per stratum (B_h, C_h, n_h); () for one stratum. K: components of the cluster-stratum graph (1 without strata).
    strata: tuple[tuple[float, float, int], ...] = ()
    components: int = 1

    @property
    def estimate(self) -> float:
        return (self.gains - self.losses) / self.n

    @property
    def n_strata(self) -> int:
        return max(1, len(self.strata))

    @property
    def testable(self) -> bool:
        """Whether the clusters leave a residual degree of freedom (G - K >= 1; without strata G >= 2)."""
        return self.n_clusters - self.components >= 1

    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.strata:
            return np.array([self.gains]), np.array([self.losses]), np.array([float(self.n)])
        gains, losses, sizes = (np.array(column, dtype=float) for column in zip(*self.strata))
        return gains, losses, sizes

    def z(self, delta: float) -> float:
        if not self.strata:
            return float(score_z(delta, self.gains, self.losses, self.n, self.deff))
        return float(stratified_z(delta, *self._tables(), self.deff))

    def p_greater(self, delta: float) -> float:
        """One-sided p of H0 Δ <= delta (small: Δ > delta shown). NaN without a residual degree of freedom."""
        return float(sps.t.sf(self.z(delta), self.dof)) if self.testable else math.nan

    def p_less(self, delta: float) -> float:
        """One-sided p of H0 Δ >= delta (small: Δ < delta shown)."""
        return float(sps.t.cdf(self.z(delta), self.dof)) if self.testable else math.nan

    def p_two_sided(self, delta: float = 0.0) -> float:
        if not self.testable:
            return math.nan
        return min(1.0, 2 * min(self.p_greater(delta), self.p_less(delta)))

    def interval(self, level: float) -> tuple[float, float]:
        """Two-sided ``level`` interval (each side (1 - level) / 2); (NaN, NaN) without a residual degree of freedom."""
        if not self.testable:
            return math.nan, math.nan
        critical = float(sps.t.ppf(1 - (1 - level) / 2, self.dof))
        if not self.strata:
            low, high = score_interval(self.gains, self.losses, self.n, critical, self.deff)
        else:
            low, high = stratified_interval(*self._tables(), critical, self.deff)
        return float(low), float(high)


def score_test(diffs: np.ndarray, codes: np.ndarray, strata: np.ndarray | None = None) -> ScoreTest:
    """The score test of the paired differences ``diffs`` (in [-1, 1]) with cluster ids ``codes`` (0..G-1)
    and stratum ids ``strata`` (0..H-1; None, or all 0: one stratum, exactly the unstratified test)."""
    gains, losses = np.clip(diffs, 0, None), np.clip(-diffs, 0, None)
    if strata is None or int(strata.max()) == 0:
        deff = design_effect(codes, diffs)
        return ScoreTest(n=int(diffs.size), gains=float(gains.sum()), losses=float(losses.sum()), deff=deff,
                         n_clusters=int(codes.max()) + 1, dof=score_dof(codes, diffs, deff))
    found = design(diffs, codes, strata)
    count = found.n_strata
    tables = tuple(zip(np.bincount(strata, weights=gains, minlength=count).tolist(),
                       np.bincount(strata, weights=losses, minlength=count).tolist(),
                       np.bincount(strata, minlength=count).tolist()))
    free = max(found.free, 1)
    if found.free >= 1 and found.deff > 1 + 1e-9:
        dof = float(np.clip(effective_clusters(found.resid_sums), 1.0, free))
    else:
        dof = float(free)
    return ScoreTest(n=int(diffs.size), gains=float(gains.sum()), losses=float(losses.sum()),
                     deff=found.deff if found.free >= 1 else 1.0, n_clusters=found.n_clusters, dof=dof,
                     strata=tables, components=found.components)
