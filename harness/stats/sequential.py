"""Anytime-valid sequential verdicts: a betting confidence sequence for Δ, looked at after every round.

The fixed-sample gate (:mod:`harness.stats.score`) reads one interval after *all* items of a slice
are scored. Here items are scored in rounds of whole clusters, in a seeded random cluster order,
and after every round the slice's verdict is updated from a **confidence sequence** (CS): bounds
that hold *simultaneously for every number of clusters seen*, so a slice may stop as soon as it is
settled, and looking after every round costs no α. Same rules as the gate, same margin m, same α:

* **pass** ⇔ the lower bound at level α lies above -m;
* **fail** ⇔ the upper bound at level α/k lies below -m (Bonferroni over the k gated slices);
* **open** otherwise (score the next round, or, with no items left, "inconclusive").

The method: hedged-capital betting [Waudby-Smith & Ramdas, "Estimating means of bounded random
variables by betting", JRSS-B 86:1 (2024); "WSR" below], one-sided. Observations y_1, y_2, ... in
[0, 1] with conditional mean μ. For a candidate mean m, a gambler who bets that y exceeds m owns
the capital

    K+_t(m) = ∏_{i<=t} (1 + λ+_i(m) (y_i - m)),     K-_t(m) = ∏_{i<=t} (1 - λ-_i(m) (y_i - m))

(K-: the bet that y falls short of m). If m = μ and every bet λ_i is chosen from y_1..y_{i-1}
only, each capital is a nonnegative martingale starting at 1, and Ville's inequality gives
P(∃t: K_t(μ) >= 1/α) <= α. So {m : K+_t(m) < 1/α} holds μ at every t with probability >= 1 - α:
its infimum is the lower bound; likewise the upper bound from K-. Each is at level α, the pair a
1 - 2α CS. The bets are truncated, λ+(m) = min(λ̃, c/m) and λ-(m) = min(λ̃, c/(1 - m)) with
c = ``TRUNCATION`` in (0, 1): every factor then stays >= 1 - c > 0 and is monotone in m (K+ falls,
K- rises), so each bound is one root, found by vectorised bisection. The running maximum of the
lower bounds (minimum of the upper ones) is a CS too — the event "μ excluded at some t" is the same
— and is what is reported, so bounds never widen from one look to the next.

The bet λ̃: WSR's *predictable plug-in* (their λ^PrPl), one-sided, with the running variance,

    λ̃_t = sqrt(2 log(1/α) / (σ̂²_{t-1} · s_t)),
    μ̂_t = (1/2 + Σ_{i<=t} y_i) / (t + 1),   σ̂²_t = (1/4 + Σ_{i<=t} (y_i - μ̂_i)²) / (t + 1),

about the bet that maximises the capital's growth against a sub-Gaussian alternative at the
running variance. WSR's CS takes s_t = t log(1 + t) (``horizon=None``), tightening at close to
the law-of-the-iterated-logarithm rate at every t. A slice's cluster count G is known before
anything is scored, and the gate's last look is at G, so :func:`sequential_test` takes s_t = G
(WSR's bet tuned to a sample size): any predictable bet keeps the CS valid at every t, and on
the simulated designs this doubled the pass rate at Δ = 0 and n = 1,000 (0.24 → 0.47, 400 data
sets) at the price of stopping a large drop slightly later (fraction 0.23 → 0.28). A small
running variance — a slice with rare flips — gives a bold bet, which is where betting beats any
variance-bound interval. The bets of the fail side use α/k in place of α.

Observations are clusters, not items. Items that share a source are correlated, so a
martingale argument on items would be wrong; clusters are the independent units. For cluster g
with item sum S_g (of d = quant - ref in [-1, 1]) and size n_g, x_g = S_g / n̄ with n̄ the mean
cluster size over the *whole slice* (known before any item is scored), so x_g ∈ [-M, M] with
M = max_g n_g / n̄, and for clusters drawn i.i.d. E[x_g] = E[S_g] / E[n_g] = the item-weighted Δ
(n̄ standing in for E[n_g]; exact when sizes are equal). y = (x + M) / (2M) ∈ [0, 1] and the bounds
are mapped back, Δ = M (2y - 1). Every item its own cluster gives M = 1, x = d. A slice of very
unequal clusters pays for it: M is large and one cluster moves y little.

Why betting: the data are bounded (0/1 or partial credit in [-1, 1]) and nothing else is assumed —
no normal approximation, no variance model for partial credit, no estimate of a design effect
from a handful of clusters (where the fixed gate's false-pass rate rises above α, README), and
heterogeneity between clusters, however heavy-tailed within the bound, enters only through the
running variance. Among CSs for bounded means WSR's betting ones are the tightest known in
practice, and adapt to small variance (rare flips) as Hoeffding- or Bernstein-type ones do not.

Why the order is uniformly random (``cluster_order``), not stratified: the martingale argument
needs every next cluster to have the same conditional mean given the past. A random permutation
of i.i.d. clusters is i.i.d.; an order stratified by sub-slice or task makes the conditional mean
drift along the sequence (the next cluster comes from a known stratum), and the CS would cover
the mean of a moving target, not Δ.

The cost: a CS is wider than the fixed-sample interval at the same n — it holds at every n at
once, and the betting bound spends part of α on the early looks. And it counts clusters, not
items: in a slice with no change at all (every d = 0) each cluster multiplies the capital at -m
by 1 + c·m/(M - m) (the bet at its cap c/μ), so a pass takes ``min_clusters_to_pass`` =
log(1/α) / log(1 + c m / (M - m)) clusters (296 at m = 2 pt, 116 at 5 pt, α = 0.05, equal
clusters), and more when flips both ways add variance. This is no artefact of the bets: any
procedure valid for every distribution on [-M, M] must allow that a cluster at -M is merely rare,
and needs of the order of log(1/α)·M/m clusters to rule it out. A no-change slice of 20 sources
cannot pass sequentially at a margin below 25 pt; the fixed gate passes such slices by trusting
the t approximation with 20 clusters, which is where its false-pass rate exceeds α (README,
bench_gate_oc). At the full slice the sequential test passes a slice at Δ = 0 less often than the
fixed score test; what it buys is stopping early when the answer is clear (a large drop fails
after a fraction of the items) and a false-pass rate at or below α without asymptotics, clustered
or not (``benchmarks/bench_sequential.py``, ``benchmarks/results/sequential.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["MIN_ROUND_ITEMS", "TRUNCATION", "SequentialResult", "cluster_order", "cs_bounds", "default_round_items",
           "log_capital", "look_mask", "min_clusters_to_pass", "predictable_bets", "rounds", "sequential_test",
           "slice_rounds", "state_of"]

TRUNCATION = 0.5  # c: bets truncated at c/m (lower side) and c/(1 - m) (upper); WSR suggest 1/2 or 3/4
_BISECTIONS = 50  # bounds to 2^-50 of [0, 1]: far below any printed digit
_CHUNK_ELEMENTS = 1 << 22  # (batch, looks, clusters) elements held at once in the bisection (~32 MB of float64)
MIN_ROUND_ITEMS = 8

State = Literal["pass", "fail", "open"]


def _unit(sums: ArrayLike, sizes: ArrayLike, mean_size: ArrayLike, max_size: ArrayLike | None):
    """(y in [0, 1], M, broadcast as (..., 1)) from cluster sums and sizes (module docstring)."""
    sums = np.asarray(sums, dtype=float)
    sizes = np.broadcast_to(np.asarray(sizes, dtype=float), sums.shape)
    if sums.ndim == 0 or sums.shape[-1] == 0:
        raise ValueError("cs_bounds needs at least one cluster (sums of shape (..., G), G >= 1)")
    if np.any(sizes <= 0) or not np.all(np.isfinite(sums)):
        raise ValueError("cluster sizes must be positive and sums finite")
    if np.any(np.abs(sums) > sizes * (1 + 1e-9)):
        raise ValueError("a cluster sum exceeds its size: differences d must lie in [-1, 1]")
    mean_size = np.asarray(mean_size, dtype=float)[..., None]
    top = sizes.max(axis=-1, keepdims=True) if max_size is None else np.asarray(max_size, dtype=float)[..., None]
    bound = top / mean_size
    y = np.clip((sums / mean_size + bound) / (2 * bound), 0.0, 1.0)
    return y, bound


def predictable_bets(y: np.ndarray, alpha: float, horizon: int | None = None) -> np.ndarray:
    """λ̃_t of the module docstring for every t (..., G): from y_1..y_{t-1} only (predictable).

    ``horizon`` None: WSR's predictable plug-in, t log(1 + t) in the denominator; an integer H:
    the same bet tuned to H observations (H in place of t log(1 + t); the slice's cluster count)."""
    t = np.arange(1, y.shape[-1] + 1, dtype=float)
    mu_hat = (0.5 + np.cumsum(y, axis=-1)) / (t + 1)
    var_hat = (0.25 + np.cumsum((y - mu_hat) ** 2, axis=-1)) / (t + 1)
    var_before = np.concatenate([np.full(y.shape[:-1] + (1,), 0.25), var_hat[..., :-1]], axis=-1)
    spread = t * np.log1p(t) if horizon is None else float(horizon)
    return np.sqrt(2 * math.log(1 / alpha) / (var_before * spread))


def _log_factors(y: np.ndarray, bets: np.ndarray, m: np.ndarray, side: int, truncation: float) -> np.ndarray:
    """log(1 + λ+(m)(y - m)) (side +1) or log(1 - λ-(m)(y - m)) (side -1), elementwise."""
    room = m if side > 0 else 1 - m
    lam = np.minimum(bets, truncation / np.maximum(room, 1e-300))
    return np.log1p(side * lam * (y - m))


def log_capital(sums: ArrayLike, sizes: ArrayLike, mean_size: ArrayLike, delta: ArrayLike, alpha: float,
                side: Literal["lower", "upper"], *, max_size: ArrayLike | None = None, horizon: int | None = None,
                truncation: float = TRUNCATION) -> np.ndarray:
    """log K_t at Δ = ``delta`` after each cluster t (..., G): the test form of :func:`cs_bounds`.

    ``side="lower"``: log K+_t, the evidence that Δ > delta; ``"upper"``: log K-_t, that Δ < delta.
    Up to ties, the running lower bound at level α exceeds delta after t clusters exactly when
    max_{s<=t} log K+_s(delta) >= log(1/α) (likewise the upper one): deciding at a fixed margin
    needs this one capital, no bisection (``benchmarks/bench_sequential.py``).
    """
    y, bound = _unit(sums, sizes, mean_size, max_size)
    m = np.clip((np.asarray(delta, dtype=float)[..., None] + bound) / (2 * bound), 0.0, 1.0)
    sign = 1 if side == "lower" else -1
    return np.cumsum(_log_factors(y, predictable_bets(y, alpha, horizon), m, sign, truncation), axis=-1)


def _running_bound(y: np.ndarray, bets: np.ndarray, ends: np.ndarray, threshold: float, side: int,
                   truncation: float) -> np.ndarray:
    """sup{m : max_{s<=t} K+_s(m) >= threshold} (side +1; 0 if none) or inf{...K-...} (side -1; 1 if none)
    at t = ends (J,), for y, bets (B, G): (B, J). Bisection on m; max_s K_s(m) is monotone in m."""
    batch, clusters = y.shape
    out = np.empty((batch, ends.size))
    t_chunk = max(1, min(ends.size, _CHUNK_ELEMENTS // max(1, batch * clusters)))
    b_chunk = batch if t_chunk > 1 or batch * clusters <= _CHUNK_ELEMENTS else max(1, _CHUNK_ELEMENTS // clusters)
    for b0 in range(0, batch, b_chunk):
        for j0 in range(0, ends.size, t_chunk):
            e = ends[j0:j0 + t_chunk]
            width = int(e.max())
            yy, bb = y[b0:b0 + b_chunk, None, :width], bets[b0:b0 + b_chunk, None, :width]
            after = np.arange(width)[None, None, :] >= e[None, :, None]  # clusters not yet seen at that look
            # rejected side: [0, inner] for side +1 (inner = 0 if none), [inner, 1] for side -1
            inner = np.zeros((yy.shape[0], e.size)) if side > 0 else np.ones((yy.shape[0], e.size))
            outer = 1.0 - inner
            for _ in range(_BISECTIONS):
                middle = (inner + outer) / 2
                logs = np.cumsum(_log_factors(yy, bb, middle[..., None], side, truncation), axis=-1)
                rejected = np.where(after, -np.inf, logs).max(axis=-1) >= math.log(threshold)
                inner = np.where(rejected, middle, inner)
                outer = np.where(rejected, outer, middle)
            out[b0:b0 + b_chunk, j0:j0 + t_chunk] = inner
    return out


def cs_bounds(sums: ArrayLike, sizes: ArrayLike, mean_size: ArrayLike, alpha: float, *,
              looks: ArrayLike | None = None, max_size: ArrayLike | None = None, horizon: int | None = None,
              truncation: float = TRUNCATION) -> tuple[np.ndarray, np.ndarray]:
    """Running one-sided bounds of Δ, each at level α (together a 1 - 2α CS), in Δ units.

    ``sums``: (..., G) item sums of d per cluster, in the order the clusters are scored; ``sizes``:
    their sizes (broadcast to ``sums``); ``mean_size``: n̄ of the whole slice (per batch row, or one
    number); ``max_size``: the largest cluster of the whole slice (default: the largest in
    ``sizes``, right when ``sums`` covers the slice). ``looks``: the numbers of clusters after which
    to report (default every t = 1..G). ``horizon``: the bets (:func:`predictable_bets`; None: WSR's
    predictable plug-in; the slice's cluster count: tuned to it, as :func:`sequential_test` does). Returns (lower, upper), each (..., len(looks)): the running
    maximum / minimum over every cluster seen so far (not only over looks). A leading batch axis
    (reps, G) simulates many slices at once.
    """
    y, bound = _unit(sums, sizes, mean_size, max_size)
    shape = y.shape
    ends = np.arange(1, shape[-1] + 1) if looks is None else np.asarray(looks, dtype=int).reshape(-1)
    if ends.size and (ends.min() < 1 or ends.max() > shape[-1]):
        raise ValueError(f"looks must lie in 1..{shape[-1]}")
    flat = y.reshape(-1, shape[-1])
    bets = predictable_bets(flat, alpha, horizon)
    low = _running_bound(flat, bets, ends, 1 / alpha, +1, truncation)
    high = _running_bound(flat, bets, ends, 1 / alpha, -1, truncation)
    bound = np.broadcast_to(bound, shape[:-1] + (1,)).reshape(-1, 1)
    lower = (bound * (2 * low - 1)).reshape(shape[:-1] + (ends.size,))
    upper = (bound * (2 * high - 1)).reshape(shape[:-1] + (ends.size,))
    return lower, upper


def min_clusters_to_pass(margin: float, alpha: float, bound: float = 1.0, truncation: float = TRUNCATION) -> int:
    """Clusters a slice with no change at all (every d = 0) needs before its lower bound at level α
    exceeds -``margin``: each such cluster multiplies K+(-margin) by 1 + c·m/(M - m), ``bound`` = M
    (module docstring). A slice with fewer clusters passes only if it shows gains."""
    return math.ceil(math.log(1 / alpha) / math.log1p(truncation * margin / (bound - margin)))


def cluster_order(codes: ArrayLike, seed: int) -> np.ndarray:
    """The order in which a slice's clusters are scored: a uniform random permutation of the cluster
    ids 0..G-1 (``codes``: every item's cluster id), reproducible from ``seed``.

    Uniform, not stratified by sub-slice or task: the CS's martingale argument needs the next
    cluster to have the same conditional mean given the past, which a random permutation of i.i.d.
    clusters gives and a stratified order does not (module docstring).
    """
    clusters = int(np.asarray(codes).max()) + 1 if np.asarray(codes).size else 0
    return np.random.default_rng(seed).permutation(clusters)


def default_round_items(n_items: int) -> int:
    """~1/8 of the slice, at least ``MIN_ROUND_ITEMS`` items."""
    return max(MIN_ROUND_ITEMS, round(n_items / 8))


def look_mask(ordered_sizes: ArrayLike, round_items: int) -> np.ndarray:
    """(..., G) True after the clusters that close a round: the first cluster at which the items
    scored reach each multiple of ``round_items`` (whole clusters; a large cluster may close
    several multiples at once), and the last cluster."""
    cum = np.cumsum(np.asarray(ordered_sizes, dtype=float), axis=-1)
    steps = np.floor(cum / round_items)
    before = np.concatenate([np.zeros(steps.shape[:-1] + (1,)), steps[..., :-1]], axis=-1)
    mask = steps > before
    mask[..., -1] = True
    return mask


def rounds(order: ArrayLike, sizes: ArrayLike, round_items: int | None = None) -> list[np.ndarray]:
    """``order`` (cluster ids, as from :func:`cluster_order`) split into rounds of whole clusters of
    about ``round_items`` items (default :func:`default_round_items`); ``sizes[g]``: cluster g's size."""
    order, sizes = np.asarray(order, dtype=int), np.asarray(sizes, dtype=float)
    if order.size == 0:
        return []
    round_items = default_round_items(int(sizes.sum())) if round_items is None else int(round_items)
    if round_items < 1:
        raise ValueError(f"round_items={round_items} must be >= 1")
    ends = np.flatnonzero(look_mask(sizes[order], round_items)) + 1
    return np.split(order, ends[:-1])


@dataclass(frozen=True)
class SequentialResult:
    """The sequential verdict of one slice after its last look (see module docstring).

    ``lower`` is the running lower bound at level α (pass: > -margin), ``upper`` the running upper
    bound at level α/k (fail: < -margin); both in Δ units. The trajectory holds, per look, the items
    scored so far and both bounds then.
    """

    n: int  # items scored
    n_clusters: int  # clusters scored
    n_total: int  # items in the slice
    clusters_total: int
    estimate: float  # Δ̂ over the items scored (item-weighted)
    lower: float
    upper: float
    margin: float
    alpha: float
    family: int  # k: the fail bound is at level α / k
    state: State
    looks_items: tuple[int, ...]
    looks_lower: tuple[float, ...]
    looks_upper: tuple[float, ...]

    @property
    def fraction(self) -> float:
        """Share of the slice's items scored."""
        return self.n / self.n_total


def state_of(lower: float, upper: float, margin: float) -> State:
    """The gate's rules: pass ⇔ lower > -margin (first: a slice shown non-inferior never fails);
    fail ⇔ upper < -margin; else open."""
    if lower > -margin:
        return "pass"
    if upper < -margin:
        return "fail"
    return "open"


def slice_rounds(diffs: ArrayLike, codes: ArrayLike, margin: float, alpha: float, family: int, seed: int,
                 round_items: int | None):
    """The inputs of a sequential test checked and planned: (diffs, codes, cluster sizes, cluster sums of
    the scored items, which clusters are fully scored, the cluster order, its rounds). Shared by
    :func:`sequential_test` and :func:`harness.stats.group_sequential.spending_test`."""
    diffs, codes = np.asarray(diffs, dtype=float), np.asarray(codes, dtype=int)
    if diffs.shape != codes.shape or diffs.ndim != 1 or diffs.size == 0:
        raise ValueError("diffs and codes must be 1-d arrays of the same, positive length")
    if not 0 < margin < 1 or not 0 < alpha < 0.5 or family < 1:
        raise ValueError(f"need 0 < margin < 1, 0 < alpha < 0.5, family >= 1 (got {margin}, {alpha}, {family})")
    sizes = np.bincount(codes).astype(float)
    if np.any(sizes == 0):
        raise ValueError("cluster ids must be 0..G-1 with every id used")
    sums = np.bincount(codes, weights=np.nan_to_num(diffs))
    scored = np.bincount(codes, weights=np.isfinite(diffs).astype(float)) == sizes
    order = cluster_order(codes, seed)
    parts = rounds(order, sizes, round_items)
    return diffs, codes, sizes, sums, scored, order, parts


def sequential_test(diffs: ArrayLike, codes: ArrayLike, margin: float, *, alpha: float = 0.05, family: int = 1,
                    seed: int = 0, round_items: int | None = None, stop: bool = True) -> SequentialResult:
    """Score a slice round by round in the seeded cluster order and read the verdict after each round.

    ``diffs``: every item's d = quant - ref in [-1, 1], NaN for items not scored yet (a round is
    looked at only once all its items are scored); ``codes``: every item's cluster id 0..G-1, the
    whole slice (it fixes n̄, M, the order and the rounds before anything is scored). Stops at the
    first look whose state is pass or fail (``stop=False``: looks at every complete round).
    """
    diffs, codes, sizes, sums, scored, order, parts = slice_rounds(diffs, codes, margin, alpha, family, seed,
                                                                   round_items)
    complete = 0
    for part in parts:  # rounds whose every item is scored, from the start
        if not scored[part].all():
            break
        complete += 1
    ends = np.cumsum([part.size for part in parts])[:complete]
    seen_order = order[:ends[-1]] if complete else order[:0]
    lower_pass = upper_fail = np.zeros(0)
    if complete:
        mean_size, max_size = sizes.mean(), sizes.max()
        lower_pass, _ = cs_bounds(sums[seen_order], sizes[seen_order], mean_size, alpha, looks=ends,
                                  max_size=max_size, horizon=sizes.size)
        _, upper_fail = cs_bounds(sums[seen_order], sizes[seen_order], mean_size, alpha / family, looks=ends,
                                  max_size=max_size, horizon=sizes.size)
    used = complete
    if stop:
        for j in range(complete):
            if state_of(lower_pass[j], upper_fail[j], margin) != "open":
                used = j + 1
                break
    clusters_used = int(ends[used - 1]) if used else 0
    chosen = order[:clusters_used]
    n = int(sizes[chosen].sum())
    lower = float(lower_pass[used - 1]) if used else -1.0
    upper = float(upper_fail[used - 1]) if used else 1.0
    return SequentialResult(
        n=n, n_clusters=clusters_used, n_total=int(diffs.size), clusters_total=int(sizes.size),
        estimate=float(sums[chosen].sum() / n) if n else math.nan, lower=lower, upper=upper, margin=float(margin),
        alpha=float(alpha), family=int(family), state=state_of(lower, upper, margin),
        looks_items=tuple(int(v) for v in np.cumsum(sizes[order])[ends[:used] - 1]),
        looks_lower=tuple(float(v) for v in lower_pass[:used]), looks_upper=tuple(float(v) for v in upper_fail[:used]))
