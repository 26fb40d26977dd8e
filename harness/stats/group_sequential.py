"""Group-sequential verdicts: the clustered score test at planned looks, with α spent by a spending function.

An alternative to the betting confidence sequence of :mod:`harness.stats.sequential`, with the same
inputs, rounds, rules and result (:func:`spending_test` has :func:`~harness.stats.sequential.sequential_test`'s
signature), for slices whose few clusters keep the betting CS from ever settling early. The slice is
scored in the same rounds of whole clusters, in the same seeded random cluster order, and after
every complete round ("look" k, at information fraction t_k = items scored / items in the slice) the
slice's own fixed-sample statistic (:func:`harness.stats.score.score_test` on the items scored so
far) is compared with a **group-sequential boundary**:

* **pass** ⇔ the score test's one-sided p of H0 Δ <= -m is below the nominal level p_k = 1 - Φ(c_k),
  where c_1..c_K are the boundaries at α; equivalently the lower bound of the score interval of
  two-sided level 1 - 2 p_k lies above -m;
* **fail** ⇔ its p of H0 Δ >= -m is below the nominal level of the boundaries at α/k (Bonferroni
  over the k gated slices, as the gate does); equivalently that interval's upper bound lies below -m;
* **open** otherwise.

The boundaries [Lan & DeMets, "Discrete sequential boundaries for clinical trials", Biometrika 70
(1983) 659]. Under H0 the standardised statistics at the looks have, asymptotically, the canonical
joint distribution: Z_k = W(t_k)/√t_k for a standard Brownian motion W, so corr(Z_j, Z_k) =
√(t_j/t_k). A spending function α(t), increasing from α(0) = 0 to α(1) = α, fixes how much of α may
be used up by each look: c_k solves

    P_H0(Z_1 < c_1, ..., Z_{k-1} < c_{k-1}, Z_k >= c_k) = α(t_k) - α(t_{k-1}),

so the chance of ever crossing is α whatever the number and spacing of the looks, which need not be
equal (a slice's rounds are whole clusters). ``"obf"``: the O'Brien–Fleming-type α(t) = 2 - 2Φ(z_{1-α/2}/√t)
(almost nothing at the first looks — a pass or fail there needs an extreme Z — and a last boundary
close to the fixed-sample z_{1-α}: 2.031 against 1.960 at α = 0.025 with five equal looks);
``"pocock"``: α ln(1 + (e - 1) t) (about equal nominal levels at every look: earlier stops, a last
boundary further above z_{1-α}). The default is ``"obf"``: the looks are meant to catch slices whose
answer is clear, and the power at the last look stays near the fixed gate's.

The crossing probabilities: the recursive numerical integration of Armitage, McPherson & Rowe (1969)
[as in Jennison & Turnbull, *Group Sequential Methods with Applications to Clinical Trials* (2000),
ch. 19], on the score scale S_k = Z_k √t_k = W(t_k) and with probability masses rather than
densities: the sub-probability of paths still below every boundary is held in cells of width
``_GRID_STEP`` on a fixed grid; one look moves it on by the exact normal increment of variance
t_k - t_{k-1} (a convolution, done by FFT) and cuts it at the boundary b_k = c_k √t_k (the cell
holding b_k keeps exactly the mass below it). The crossing probability of look k is then a sum of
exact normal tails, Σ_i m_i (1 - Φ((b_k - u_i)/σ_k)), and b_k is its root (Brent). Why this and not
``scipy.stats.multivariate_normal.cdf``: Genz's quasi-Monte-Carlo integration is random at about
1e-5 and costs a K-dimensional integral per root-finding step; the recursion is deterministic,
smooth in c_k, linear in K and stays exact for looks however close together (cell masses from normal
cdf differences, not density values, so a narrow increment cannot fall between grid points). It
costs a few ms per look (10 looks: < 0.1 s) and reproduces published boundaries to 3 decimals
(``tests/test_stats_group_sequential.py``). When α(t_k) - α(t_{k-1}) is below ~1e-15 the look
cannot reject: c_k = +inf (nominal level 0).

Repeated confidence bounds [Jennison & Turnbull 2000, ch. 9]. ``lower`` at look k is the lower bound
of the score interval whose one-sided level is p_k; since Z(δ) falls monotonically in δ and
P_H0(∃k: Z_k(Δ) >= c_k) = α at the true Δ, the bounds of all looks hold Δ simultaneously with
probability >= 1 - α, which is what makes "pass ⇔ lower > -m" at any look a valid α-level decision.
The running maximum of these lower bounds (minimum of the upper ones) would be valid as well — the
event "some look's bound excludes Δ" is the same — but it is not needed: a slice stops at its first
look that settles it, so the reported bound is that look's own, and with ``stop=False`` the
per-look bounds are reported as they are.

What is asymptotic. Everything the score test is: the nominal levels are mapped to critical values
through the score test's own t reference (pass ⇔ Z(-m) > t_{1-p_k, ν}, ν = its degrees of freedom
at that look: G - 1 of the clusters seen, or their effective number when the design effect exceeds
1), the usual nominal-significance-level approximation for a statistic whose variance is estimated.
The joint normality of the looks' statistics with correlation √(t_j/t_k) holds as the number of
clusters grows; information is counted in items (t = items scored / items), which is right when
clusters are of equal size and the design effect does not drift along the sequence. With a handful of
clusters the first looks rest on very few clusters and inherit the score test's few-cluster
behaviour (README, ``benchmarks/bench_gate_oc.py``: its false-pass rate exceeds α with 5-10
clusters and an intra-cluster correlation of 0.05-0.2) — and repeat it at every look. Unlike the
betting CS, which is valid without assumptions and so never settles a 10-cluster slice early, this
test is exactly as trustworthy as the fixed gate, no more.

The cost, measured (``benchmarks/bench_sequential.py --method both``: 612 designs x 800 data sets,
``benchmarks/results/sequential.md``; the designs of ``bench_gate_oc``, rounds of ~1/8 of the slice,
fail at α/5). Against betting: on clustered slices (5-50 clusters) it is the only one of the two that
stops early at all — at Δ = -5m a slice is scored to a median 60 % of its items with 50 clusters and
90 % with 20 (betting: 100 %, it never fails them), and at Δ = 0 to 84 % and 88 % — and its pass rate
at Δ = 0 stays near the fixed gate's (50 clusters, n = 1,000, m = 2 pt: 0.36 against 0.43; betting
0.00). With every item its own cluster it is not better on items: it passes a no-change slice more
often than betting (n = 1,000: 0.61 against 0.51) but stops a clear drop later (Δ = -5m: 37 % of the
items against 28 %; at Δ = 0, n = 2,000: 54 % against 35 %), since O'Brien–Fleming spending keeps
the first looks' boundaries high (eight equal looks: c = 5.42, 3.75, 3.00, ..., 1.78 at α = 0.05,
and 7.19, 5.02, 4.05, ..., 2.41 on the fail side at α/5 = 0.01). With 5-10 clusters it rarely stops
early: the score test itself has little power there. Against the fixed gate: the last boundary
costs some power (pass rate at Δ = 0 lower by 0.00-0.10, typically 0.02-0.05), and the false-pass
rate follows the fixed gate's — within Monte-Carlo error of it where the fixed gate holds α (every
item its own cluster: at most 0.064 against 0.058, α + 3 SE = 0.073; 50 clusters: 0.049 against
0.059) but *above* it where the fixed gate is already anti-conservative, since every look is another
chance for the few-cluster approximation to err: 35 designs above α + 3 SE against the fixed gate's
25, all with 5-10 clusters, up to 0.24 against 0.16 (10 clusters, ρ = 0.2, one-way losses, n = 1,000).
Use it where the fixed gate is trusted (≳ 20 clusters, README); below that betting is the valid one.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize
from scipy import signal
from scipy import special
from scipy import stats as sps

from harness.stats.score import score_test
from harness.stats.sequential import SequentialResult, slice_rounds, state_of

__all__ = ["SPENDING", "SPENDING_TEST_FUNCTION", "crossing_probabilities", "nominal_levels", "spending_boundaries", "spending_function",
           "spending_test"]

Spending = Literal["obf", "pocock"]
SPENDING = ("obf", "pocock")
SPENDING_TEST_FUNCTION: Spending = "obf"  # what spending_test spends α with (same signature as sequential_test)
_GRID_STEP = 0.002  # cell width on the score scale S = W(t) (sd <= 1): crossing probabilities to ~1e-7
_GRID_LOW = -10.0  # mass of W(t) below -10 sd: < 1e-23, dropped
_GRID_HIGH = 10.0  # cells above are never kept (no boundary b_k = c_k √t_k lies above this for α > 1e-20)
_MIN_SPEND = 1e-15  # a look allowed less than this cannot reject: c_k = +inf


def spending_function(t: ArrayLike, alpha: float, spending: Spending = "obf") -> np.ndarray:
    """α(t), the share of α that may be used by information fraction t in [0, 1] (module docstring)."""
    t = np.clip(np.asarray(t, dtype=float), 0.0, 1.0)
    if spending == "obf":
        with np.errstate(divide="ignore"):
            z = sps.norm.isf(alpha / 2) / np.sqrt(t)
        return 2 * sps.norm.sf(z)  # 2 - 2Φ(z), exact in the far tail
    if spending == "pocock":
        return alpha * np.log1p((math.e - 1) * t)
    raise ValueError(f"spending must be one of {SPENDING} (got {spending!r})")


def _check_fractions(fractions: ArrayLike) -> np.ndarray:
    t = np.asarray(fractions, dtype=float).reshape(-1)
    if t.size == 0 or not np.all(np.isfinite(t)) or t[0] <= 0 or np.any(np.diff(t) <= 0) or t[-1] > 1 + 1e-12:
        raise ValueError(f"information fractions must increase strictly within (0, 1] (got {t.tolist()})")
    return np.minimum(t, 1.0)


class _Paths:
    """Sub-probability masses of W(t) on paths still below every boundary so far, on a fixed grid."""

    def __init__(self) -> None:
        cells = int(round((_GRID_HIGH - _GRID_LOW) / _GRID_STEP))
        self.centres = _GRID_LOW + _GRID_STEP * np.arange(cells + 1)  # 0 is a centre: W(0) = 0 exactly
        self.mass = np.zeros_like(self.centres)
        self.mass[int(round(-_GRID_LOW / _GRID_STEP))] = 1.0
        self.time = 0.0

    def crossing(self, bound: float, sd: float) -> float:
        """P(still below so far, W(t_next) >= bound) for an increment of standard deviation ``sd``."""
        keep = self.mass > 0
        return float(np.dot(self.mass[keep], special.ndtr((self.centres[keep] - bound) / sd)))

    def advance(self, bound: float, sd: float) -> None:
        """Move the masses on by a N(0, sd²) increment, then drop what lies at or above ``bound``."""
        h = _GRID_STEP
        reach = int(math.ceil(9 * sd / h)) + 1
        offsets = np.arange(-reach, reach + 1) * h
        kernel = np.diff(special.ndtr(np.concatenate([offsets - h / 2, [offsets[-1] + h / 2]]) / sd))
        moved = signal.fftconvolve(self.mass, kernel, mode="full")[reach:reach + self.mass.size]
        moved = np.maximum(moved, 0.0)  # FFT round-off
        if math.isfinite(bound):
            edges = self.centres - h / 2
            cut = int(np.searchsorted(edges, bound, side="right")) - 1  # the cell holding the bound
            if cut < 0:
                moved[:] = 0.0
            elif cut < moved.size:
                # the part of that cell below the bound, exactly: Σ_i m_i [Φ((b - u_i)/σ) - Φ((e - u_i)/σ)]
                keep = self.mass > 0
                u, m = self.centres[keep], self.mass[keep]
                moved[cut] = float(np.dot(m, special.ndtr((bound - u) / sd) - special.ndtr((edges[cut] - u) / sd)))
                moved[cut + 1:] = 0.0
        self.mass = moved


def crossing_probabilities(fractions: ArrayLike, boundaries: ArrayLike) -> np.ndarray:
    """P_H0(Z_1 < c_1, ..., Z_{k-1} < c_{k-1}, Z_k >= c_k) for each look k, under the canonical joint
    distribution (Z_k = W(t_k)/√t_k); ``boundaries`` may hold +inf (a look that cannot reject)."""
    t = _check_fractions(fractions)
    c = np.asarray(boundaries, dtype=float).reshape(-1)
    if c.size != t.size:
        raise ValueError("need one boundary per look")
    paths, out, before = _Paths(), np.zeros(t.size), 0.0
    for k in range(t.size):
        sd, bound = math.sqrt(t[k] - before), c[k] * math.sqrt(t[k])
        out[k] = paths.crossing(bound, sd) if math.isfinite(bound) else 0.0
        paths.advance(bound, sd)
        before = t[k]
    return out


def spending_boundaries(fractions: ArrayLike, alpha: float, spending: Spending = "obf") -> np.ndarray:
    """One-sided critical values c_1..c_K on the Z scale for looks at information ``fractions``
    t_1 < ... < t_K (t_K = 1 for the full slice; a design stopped short of 1 spends only α(t_K)),
    such that look k's crossing probability under H0 is α(t_k) - α(t_{k-1}) (module docstring).
    +inf where a look may spend less than 1e-15."""
    if not 0 < alpha < 0.5:
        raise ValueError(f"need 0 < alpha < 0.5 (got {alpha})")
    t = _check_fractions(fractions)
    spent = spending_function(np.concatenate([[0.0], t]), alpha, spending)
    paths, out, before = _Paths(), np.full(t.size, np.inf), 0.0
    for k in range(t.size):
        sd, target = math.sqrt(t[k] - before), float(spent[k + 1] - spent[k])
        root_t = math.sqrt(t[k])
        bound = math.inf
        if target >= _MIN_SPEND:
            if k == 0:  # W(t_1) ~ N(0, t_1) exactly
                bound = float(sps.norm.isf(target)) * root_t
            else:
                low, high = _GRID_LOW, _GRID_HIGH + 40 * sd
                if paths.crossing(low, sd) > target:
                    bound = optimize.brentq(lambda b: paths.crossing(b, sd) - target, low, high,
                                            xtol=1e-10, rtol=1e-14, maxiter=200)
            out[k] = bound / root_t
        paths.advance(bound, sd)
        before = t[k]
    return out


def nominal_levels(fractions: ArrayLike, alpha: float, spending: Spending = "obf") -> np.ndarray:
    """p_k = 1 - Φ(c_k): the one-sided p-value each look's test must fall below (0 where c_k = +inf)."""
    return sps.norm.sf(spending_boundaries(fractions, alpha, spending))


def _look(diffs: np.ndarray, codes: np.ndarray, margin: float, level_pass: float, level_fail: float,
          strata: np.ndarray | None = None):
    """(lower, upper) of one look: score bounds at the nominal one-sided levels; -1 / 1 where the look
    cannot decide (nominal level 0, or no residual degree of freedom: fewer than 2 clusters scored)."""
    _, relabelled = np.unique(codes, return_inverse=True)
    layers = None if strata is None else np.unique(strata, return_inverse=True)[1]
    test = score_test(diffs, relabelled, layers)
    if not test.testable:
        return -1.0, 1.0
    lower = test.interval(1 - 2 * level_pass)[0] if level_pass > 0 else -1.0
    upper = test.interval(1 - 2 * level_fail)[1] if level_fail > 0 else 1.0
    return float(lower), float(upper)


def spending_test(diffs: ArrayLike, codes: ArrayLike, margin: float, *, alpha: float = 0.05, family: int = 1,
                  seed: int = 0, round_items: int | None = None, stop: bool = True,
                  strata: ArrayLike | None = None) -> SequentialResult:
    """Score a slice round by round in the seeded cluster order and read the group-sequential verdict
    after each round (module docstring); a drop-in for :func:`harness.stats.sequential.sequential_test`.

    ``diffs``: every item's d = quant - ref in [-1, 1], NaN for items not scored yet (a round is
    looked at only once all its items are scored); ``codes``: every item's cluster id 0..G-1, the
    whole slice (it fixes the order, the rounds and so the looks' information fractions before
    anything is scored). Stops at the first look whose state is pass or fail (``stop=False``: looks
    at every complete round). Spending function: ``SPENDING_TEST_FUNCTION`` (O'Brien–Fleming type). ``lower``: the look's repeated lower bound at level α (pass ⇔ > -margin);
    ``upper``: its repeated upper bound at level α/``family`` (fail ⇔ < -margin). ``strata``: every
    item's stratum id (None: one stratum); each look's score test is then stratified over the items
    seen (:mod:`harness.stats.strata`), the order and rounds stay those of the clusters.
    """
    layers = None if strata is None else np.asarray(strata)
    if layers is not None and layers.shape != np.shape(diffs):
        raise ValueError(f"strata has shape {layers.shape}, expected {np.shape(diffs)}: one stratum id per item")
    diffs, codes, sizes, sums, scored, order, parts = slice_rounds(diffs, codes, margin, alpha, family, seed,
                                                                   round_items)
    ends = np.cumsum([part.size for part in parts])
    items_at = np.cumsum(sizes[order])[ends - 1]  # items scored at each planned look
    fractions = items_at / diffs.size
    complete = 0
    for part in parts:  # rounds whose every item is scored, from the start
        if not scored[part].all():
            break
        complete += 1
    level_pass = nominal_levels(fractions, alpha, SPENDING_TEST_FUNCTION)
    level_fail = nominal_levels(fractions, alpha / family, SPENDING_TEST_FUNCTION)
    rank = np.empty(sizes.size, dtype=int)
    rank[order] = np.arange(sizes.size)  # position of each cluster in the order
    item_rank = rank[codes]
    lowers, uppers = [], []
    for j in range(complete):
        seen = item_rank < ends[j]
        low, high = _look(diffs[seen], codes[seen], margin, float(level_pass[j]), float(level_fail[j]),
                          None if layers is None else layers[seen])
        lowers.append(low)
        uppers.append(high)
        if stop and state_of(low, high, margin) != "open":
            break
    used = len(lowers)
    clusters_used = int(ends[used - 1]) if used else 0
    chosen = order[:clusters_used]
    n = int(sizes[chosen].sum())
    lower = lowers[-1] if used else -1.0
    upper = uppers[-1] if used else 1.0
    return SequentialResult(
        n=n, n_clusters=clusters_used, n_total=int(diffs.size), clusters_total=int(sizes.size),
        estimate=float(sums[chosen].sum() / n) if n else math.nan, lower=float(lower), upper=float(upper),
        margin=float(margin), alpha=float(alpha), family=int(family), state=state_of(lower, upper, margin),
        looks_items=tuple(int(v) for v in items_at[:used]),
        looks_lower=tuple(float(v) for v in lowers), looks_upper=tuple(float(v) for v in uppers))
