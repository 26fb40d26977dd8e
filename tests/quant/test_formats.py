"""Number formats against independent references: hand-enumerated grids, hand-worked examples, torch dtypes."""

from __future__ import annotations

import bisect
import math

import pytest
import torch

from harness.quant.format_table import bits_per_element
from harness.quant.format_math import (
    NVFP4_ZERO_BLOCK_SCALE,
    e2m1_round,
    fp8_cast,
    fp8_quantize,
    int_fake_quant,
    int_qparams,
    int_quantize,
    mx_quantize,
    nvfp4_quantize,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NAN, INF = float("nan"), float("inf")


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (reference - approx).double().pow(2).sum()
    return float(10 * torch.log10(reference.double().pow(2).sum() / noise))


def e4m3_table() -> list[tuple[float, int]]:
    """All finite non-negative E4M3 (fn) values with their mantissa bits, from the bit layout by hand.

    1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m/8 · 2^-6);
    S.1111.111 is NaN and there is no infinity, so the largest value is 1.75 · 2^8 = 448.
    """
    table = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue
            if exponent == 0:
                value = mantissa / 8 * 2.0**-6
            else:
                value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
            table.append((value, mantissa))
    return sorted(table)


E4M3 = e4m3_table()
E4M3_VALUES = [v for v, _ in E4M3]


def e4m3_reference(x: float) -> float:
    """Saturating round-to-nearest-even onto the hand-built E4M3 table (pure Python)."""
    if math.isnan(x):
        return x
    magnitude = min(abs(x), 448.0)
    i = bisect.bisect_left(E4M3_VALUES, magnitude)
    if i < len(E4M3) and E4M3_VALUES[i] == magnitude:
        result = magnitude
    else:
        (low, low_m), (high, high_m) = E4M3[i - 1], E4M3[i]
        if magnitude - low != high - magnitude:
            result = low if magnitude - low < high - magnitude else high
        else:
            result = low if low_m % 2 == 0 else high
    return math.copysign(result, x)


# ------------------------------------------------------------------------------------------- FP8
def test_e4m3_table_has_the_documented_extremes() -> None:
    assert len(E4M3) == 127  # 0 plus 126 positive values
    assert E4M3_VALUES[1] == 2.0**-9 and E4M3_VALUES[-1] == 448.0


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cast_keeps_every_e4m3_value_and_rounds_midpoints_to_even(device: str) -> None:
    values = torch.tensor(E4M3_VALUES, dtype=torch.float32, device=device)
    torch.testing.assert_close(fp8_cast(values), values, rtol=0, atol=0)
    torch.testing.assert_close(fp8_cast(-values), -values, rtol=0, atol=0)

    midpoints, expected = [], []
    for (low, low_m), (high, high_m) in zip(E4M3[:-1], E4M3[1:]):
        midpoints.append((low + high) / 2)  # 5 significant bits: exact in float32
        expected.append(low if low_m % 2 == 0 else high)
    mid = torch.tensor(midpoints, device=device)
    want = torch.tensor(expected, device=device)
    torch.testing.assert_close(fp8_cast(mid), want, rtol=0, atol=0)
    torch.testing.assert_close(fp8_cast(-mid), -want, rtol=0, atol=0)
    # just off the midpoint the nearer neighbour wins, whatever its parity
    lows = torch.tensor([low for low, _ in E4M3[:-1]], device=device)
    highs = torch.tensor([high for high, _ in E4M3[1:]], device=device)
    torch.testing.assert_close(fp8_cast(torch.nextafter(mid, lows)), lows, rtol=0, atol=0)
    torch.testing.assert_close(fp8_cast(torch.nextafter(mid, highs)), highs, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cast_matches_torch_and_pure_python_on_random_values(device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** (torch.rand(100_000, generator=generator) * 16 - 10)  # 1e-10 … 1e6
    x = (torch.randn(100_000, generator=generator).sign() * magnitudes).to(device)
    got = fp8_cast(x)
    torch_reference = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    torch.testing.assert_close(got, torch_reference, rtol=0, atol=0)
    python_reference = torch.tensor([e4m3_reference(v) for v in x.cpu().tolist()])
    torch.testing.assert_close(got.cpu(), python_reference, rtol=0, atol=0)
    assert (x.abs() > 464).any() and got.abs().max() == 448


def test_fp8_cast_special_values_and_e5m2() -> None:
    x = torch.tensor([NAN, INF, -INF, 1e30, -1e30, 0.0])
    torch.testing.assert_close(
        fp8_cast(x), torch.tensor([NAN, 448, -448, 448, -448, 0.0]), equal_nan=True, rtol=0, atol=0
    )
    # E5M2 has 2 mantissa bits, so [4, 8) holds 4, 5, 6, 7: ties 4.5 → 4, 5.5 → 6, 7.5 → 8
    e5m2 = fp8_cast(torch.tensor([1e9, 3.0, 4.5, 5.5, 7.5]), "e5m2")
    torch.testing.assert_close(e5m2, torch.tensor([57344.0, 3.0, 4.0, 6.0, 8.0]), rtol=0, atol=0)


def test_fp8_cast_preserves_dtype_and_shape() -> None:
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    y = fp8_cast(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


def test_fp8_quantize_per_tensor_known_answer() -> None:
    # amax 896 → scale 2; 3.3/2 = 1.65 → E4M3 1.625 (step 1/8 in [1, 2)) → 3.25;
    # -100/2 = -50 is a tie between 48 (mantissa 4) and 52 (mantissa 5) → -48 → -96
    out = fp8_quantize(torch.tensor([896.0, 3.3, -0.0, -100.0]))
    torch.testing.assert_close(out, torch.tensor([896.0, 3.25, 0.0, -96.0]), rtol=0, atol=0)


def test_fp8_quantize_granularities_and_static_scale() -> None:
    # per channel: each row's amax maps to 448 (scales 1 and 1/128), so both rows are exact
    x = torch.tensor([[448.0, 1.0, -0.5], [3.5, 0.0, 1.0 / 64]])
    torch.testing.assert_close(fp8_quantize(x, granularity="channel"), x, rtol=0, atol=0)
    # per tensor: scale 1, so 1/64 is still exact but 3.3 is not
    assert fp8_quantize(torch.tensor([448.0, 3.3]))[1] == 3.25
    assert torch.equal(fp8_quantize(torch.zeros(2, 4), granularity="group", group_size=2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="group_size=3 does not divide the last dimension \\(4\\)"):
        fp8_quantize(torch.ones(2, 4), granularity="group", group_size=3)
    # static scale 2 applies to every element; granularity is ignored
    static = fp8_quantize(torch.tensor([3.3, 2000.0]), scale=torch.tensor(2.0), granularity="channel")
    torch.testing.assert_close(static, torch.tensor([3.25, 896.0]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="positive and finite"):
        fp8_quantize(x, scale=torch.tensor(0.0))


def test_fp8_block_matches_a_hand_loop_with_partial_edge_tiles() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, generator=generator) * torch.tensor([1.0, 100.0, 1.0, 0.01, 1.0, 1.0, 1.0])
    x[3:, 4:] = 0.0  # an all-zero edge tile
    got = fp8_quantize(x, granularity="block", block_shape=(2, 4))
    want = torch.empty_like(x)
    for r in range(0, 5, 2):
        for c in range(0, 7, 4):
            tile = x[r : r + 2, c : c + 4]
            amax = float(tile.abs().max())
            scale = amax / 448 if amax > 0 else 1.0
            want[r : r + 2, c : c + 4] = torch.tensor(
                [[e4m3_reference(v / scale) * scale for v in row] for row in tile.tolist()]
            )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(got[4:, 4:], torch.zeros(1, 3))
    with pytest.raises(ValueError, match="2-D"):
        fp8_quantize(torch.ones(2, 2, 2), granularity="block")


def test_fp8_quantize_nan_and_inf_stay_local() -> None:
    x = torch.tensor([[NAN, INF, 896.0, 3.3], [1.0, 2.0, 3.0, 4.0]])
    out = fp8_quantize(x, granularity="channel")
    assert math.isnan(out[0, 0]) and out[0, 1] == 896.0  # Inf saturates to 448 · scale 2
    torch.testing.assert_close(out[0, 2:], torch.tensor([896.0, 3.25]), rtol=0, atol=0)
    assert torch.isfinite(out[1]).all()


# ------------------------------------------------------------------------------------------- E2M1
def test_e2m1_grid_ties_saturation_and_sign() -> None:
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    torch.testing.assert_close(e2m1_round(grid), grid, rtol=0, atol=0)
    torch.testing.assert_close(e2m1_round(-grid), -grid, rtol=0, atol=0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    tie_results = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # to the even mantissa, by hand
    torch.testing.assert_close(e2m1_round(ties), tie_results, rtol=0, atol=0)
    torch.testing.assert_close(e2m1_round(-ties), -tie_results, rtol=0, atol=0)
    near = torch.tensor([0.26, 1.74, 2.49, 4.99, 5.01, 6.5, 100.0, INF, -INF])
    torch.testing.assert_close(
        e2m1_round(near), torch.tensor([0.5, 1.5, 2.0, 4.0, 6.0, 6.0, 6.0, 6.0, -6.0]), rtol=0, atol=0
    )
    assert math.isnan(e2m1_round(torch.tensor([NAN]))[0])
    assert torch.signbit(e2m1_round(torch.tensor([-0.1])))[0]


# ------------------------------------------------------------------------------------------- INT
def test_int4_symmetric_known_answers() -> None:
    # amax 1.75 → scale 1.75/7 = 0.25; x/scale = 7, -2.5, 1.5, 0.4, -4, 3.5 → 7, -2, 2, 0, -4, 4
    x = torch.tensor([[1.75, -0.625, 0.375, 0.1, -1.0, 0.875], [0.0] * 6])
    want = torch.tensor([[1.75, -0.5, 0.5, 0.0, -1.0, 1.0], [0.0] * 6])
    torch.testing.assert_close(int_quantize(x, 4), want, rtol=0, atol=0)
    scale, zero = int_qparams(x, 4, symmetric=True, dim=-1)
    torch.testing.assert_close(scale, torch.tensor([[0.25], [1.0]]), rtol=0, atol=0)
    assert torch.equal(zero, torch.zeros(2, 1))
    # the restricted range: -amax maps to -7, never to -8
    assert int_quantize(torch.tensor([-1.75, 1.0]), 4, granularity="tensor")[0] == -1.75


def test_int4_asymmetric_known_answers() -> None:
    # min -1, max 2.75 → scale 3.75/15 = 0.25, zero round(4) = 4
    # q = round(x/0.25) + 4: -1→0, 2.75→15, 0.3→5 (1.2→1), 0.625→6 (2.5→2), 0.375→6 (1.5→2)
    x = torch.tensor([[-1.0, 2.75, 0.3, 0.625, 0.375]])
    scale, zero = int_qparams(x, 4, symmetric=False, dim=-1)
    assert scale.item() == 0.25 and zero.item() == 4.0
    torch.testing.assert_close(
        int_quantize(x, 4, symmetric=False), torch.tensor([[-1.0, 2.75, 0.25, 0.5, 0.5]]), rtol=0, atol=0
    )
    # all positive: widened to [0, 3.75] → scale 0.25, zero 0
    positive = torch.tensor([[1.0, 2.0, 3.75, 0.6]])
    scale, zero = int_qparams(positive, 4, symmetric=False, dim=-1)
    assert scale.item() == 0.25 and zero.item() == 0.0
    torch.testing.assert_close(int_quantize(positive, 4, symmetric=False), torch.tensor([[1.0, 2.0, 3.75, 0.5]]))
    # without widening: [0.75, 4.5] → scale 0.25, zero round(-3) = -3, outside [0, 15] by design
    narrow = torch.tensor([[0.75, 4.5, 2.0, 1.1]])
    scale, zero = int_qparams(narrow, 4, symmetric=False, dim=-1, include_zero=False)
    assert scale.item() == 0.25 and zero.item() == -3.0
    got = int_fake_quant(narrow, scale, zero, 4, symmetric=False)
    torch.testing.assert_close(got, torch.tensor([[0.75, 4.5, 2.0, 1.0]]), rtol=0, atol=0)


def test_int_group_known_answers_and_bad_group_size() -> None:
    x = torch.tensor([[1.75, 0.3, -0.875, 0.0, 7.0, -2.5, 1.0, 3.0]])
    # group 1: scale 0.25 → 1.75, 0.25 (1.2→1), -0.875 (-3.5→-4 → -1.0), 0; group 2: scale 1 → 7, -2 (tie), 1, 3
    want = torch.tensor([[1.75, 0.25, -1.0, 0.0, 7.0, -2.0, 1.0, 3.0]])
    torch.testing.assert_close(int_quantize(x, 4, granularity="group", group_size=4), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"group_size=3 does not divide the last dimension \(8\)"):
        int_quantize(x, 4, granularity="group", group_size=3)
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        int_quantize(x, 4, granularity="group")


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "group", "token"])
def test_int_all_zero_and_constant_slices(symmetric: bool, granularity: str) -> None:
    zeros = torch.zeros(3, 8)
    out = int_quantize(zeros, 4, symmetric=symmetric, granularity=granularity, group_size=4)
    assert torch.equal(out, zeros)
    constant = torch.full((2, 8), -3.3)
    out = int_quantize(constant, 4, symmetric=symmetric, granularity=granularity, group_size=4)
    torch.testing.assert_close(out, constant)
    narrow = int_quantize(constant, 4, symmetric=False, include_zero=False, granularity=granularity, group_size=4)
    torch.testing.assert_close(narrow, constant)


def test_int_nan_and_inf_stay_local() -> None:
    x = torch.tensor([[1.0, NAN, INF, -INF, -0.5]])
    for symmetric in (True, False):
        out = int_quantize(x, 8, symmetric=symmetric)
        assert math.isnan(out[0, 1]) and torch.isfinite(out[0, [0, 2, 3, 4]]).all()
        # Inf saturates to the grid end: +1.0 both ways, -1.0 symmetric, min = -0.5 asymmetric
        assert out[0, 2] == pytest.approx(1.0) and out[0, 3] == pytest.approx(-1.0 if symmetric else -0.5)
        torch.testing.assert_close(out[0, [0, 4]], torch.tensor([1.0, -0.5]), atol=0.01, rtol=0)


def test_int_preserves_dtype_and_rejects_bad_bits() -> None:
    x = torch.randn(4, 8, dtype=torch.float16)
    assert int_quantize(x, 4, granularity="group", group_size=4).dtype == torch.float16
    with pytest.raises(ValueError, match="bits must be an integer in \\[2, 16\\], got 1"):
        int_quantize(x, 1)


# ------------------------------------------------------------------------------------------ NVFP4
def test_nvfp4_hand_worked_blocks() -> None:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    exact_block = grid + [-v for v in grid]  # amax 6 → gs = 2688/6 = 448, s_b = e4m3(448) = 448, scale 1
    small_block = [1.0, -1.0, 0.5, 0.25] + [0.0] * 12
    x = torch.tensor([exact_block, small_block])
    out = nvfp4_quantize(x)
    torch.testing.assert_close(out[0], x[0], rtol=0, atol=0)
    # small block: s_b = e4m3(448 · 1/6 = 74.67) = 72 (step 8 in [64, 128)); scale 72/448
    # 1 → 6.22 → 6; 0.5 → 3.11 → 3; 0.25 → 1.56 → 1.5
    want = torch.tensor([6.0, -6.0, 3.0, 1.5] + [0.0] * 12) * 72 / 448
    torch.testing.assert_close(out[1], want, rtol=1e-6, atol=0)


def test_nvfp4_static_global_scale() -> None:
    # gs 448, block amax 3 → s_b = e4m3(224) = 224 → scale 0.5: 0.5 · E2M1 grid is exact, 2.5 → 5 → 4 → 2
    x = torch.tensor([[3.0, -2.0, 1.0, 0.5, 0.75, -1.5, 0.25, 0.0] * 2])
    torch.testing.assert_close(nvfp4_quantize(x, global_scale=448.0), x, rtol=0, atol=0)
    x[0, 1] = -2.5
    assert nvfp4_quantize(x, global_scale=torch.tensor(448.0))[0, 1] == -2.0
    # the same tensor with the default global scale (2688/3 = 896): s_b = 448, scale 0.5 too
    x[0, 1] = -2.0
    torch.testing.assert_close(nvfp4_quantize(x), x, rtol=0, atol=0)


def test_nvfp4_zero_constant_tiny_and_special_blocks() -> None:
    assert torch.equal(nvfp4_quantize(torch.zeros(2, 32)), torch.zeros(2, 32))
    constant = torch.full((1, 16), 2.0)  # gs 1344, s_b = 448, scale 1/3 → 6 → 2
    torch.testing.assert_close(nvfp4_quantize(constant), constant)
    # a zero block next to a large one keeps the 0.125 block scale (no 0/0); Inf there saturates to 6·0.125/gs
    x = torch.zeros(2, 16)
    x[0, 0] = 6.0
    x[1, 3] = INF
    x[1, 4] = NAN
    out = nvfp4_quantize(x)
    assert out[1, 3].item() == pytest.approx(6 * NVFP4_ZERO_BLOCK_SCALE / 448)
    assert math.isnan(out[1, 4]) and out[1, [0, 1, 2, 5]].eq(0).all() and out[0, 0] == 6.0
    # a block far below the tensor's range rounds its scale to 0 in E4M3 → zeros, not NaN
    tiny = torch.zeros(2, 16)
    tiny[0, 0], tiny[1] = 6.0, 1e-6
    assert torch.equal(nvfp4_quantize(tiny)[1], torch.zeros(16))
    subnormal = nvfp4_quantize(torch.full((1, 16), 1e-40))
    assert torch.isfinite(subnormal).all() and (subnormal - 1e-40).abs().max() < 1e-40


def test_nvfp4_nan_inf_do_not_change_the_rest_of_the_block() -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4, 32, generator=generator)
    clean = nvfp4_quantize(x)
    dirty = x.clone()
    dirty[1, 5], dirty[2, 7] = NAN, -INF
    out = nvfp4_quantize(dirty)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 5] = mask[2, 7] = False
    dirty_zeroed = x.clone()
    dirty_zeroed[1, 5] = dirty_zeroed[2, 7] = 0.0
    torch.testing.assert_close(out[mask], nvfp4_quantize(dirty_zeroed)[mask], rtol=0, atol=0)
    assert math.isnan(out[1, 5]) and out[2, 7] < 0 and torch.isfinite(out[2, 7])
    assert sqnr_db(x, clean) > 15


def test_nvfp4_rejects_bad_width_and_keeps_dtype() -> None:
    with pytest.raises(ValueError, match=r"does not divide the last dimension \(24\)"):
        nvfp4_quantize(torch.ones(2, 24))
    assert nvfp4_quantize(torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------- MX
def _block(values: list[float], size: int = 32) -> torch.Tensor:
    return torch.tensor(values + [0.0] * (size - len(values)))


def test_mxfp4_hand_worked_blocks() -> None:
    # amax 12 → X = 2^(3-2) = 2: 12→6, 5→2.5→2 (tie)→4, 7→3.5→4 (tie)→8, 1→0.5, 0.4→0.2→0, 0.6→0.3→0.5→1
    got = mx_quantize(_block([12.0, -12.0, 5.0, 7.0, 1.0, 0.4, 0.6]))
    torch.testing.assert_close(got, _block([12.0, -12.0, 4.0, 8.0, 1.0, 0.0, 1.0]), rtol=0, atol=0)
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    exact = _block(grid + [-v for v in grid])  # amax 6 → X = 1 → exact
    torch.testing.assert_close(mx_quantize(exact), exact, rtol=0, atol=0)
    # amax 7 → X = 2^(2-2) = 1 → 7 clips to 6 (FLOOR scale); amax 8 → X = 2 → 7 → 3.5 → 4 → 8
    torch.testing.assert_close(mx_quantize(_block([7.0, 1.0])), _block([6.0, 1.0]), rtol=0, atol=0)
    torch.testing.assert_close(mx_quantize(_block([8.0, 7.0])), _block([8.0, 8.0]), rtol=0, atol=0)
    # just below 8, floor(log2) is 2, not 3 (log2 in float32 would round up to 3.0)
    below_8 = 8.0 - 2.0**-21  # the float32 just below 8
    torch.testing.assert_close(mx_quantize(_block([below_8])), _block([6.0]), rtol=0, atol=0)


def test_mx_constant_zero_and_subnormal_blocks() -> None:
    assert torch.equal(mx_quantize(torch.zeros(2, 64)), torch.zeros(2, 64))
    torch.testing.assert_close(mx_quantize(torch.full((32,), 5.0)), torch.full((32,), 4.0), rtol=0, atol=0)
    torch.testing.assert_close(mx_quantize(torch.full((32,), 3.0)), torch.full((32,), 3.0), rtol=0, atol=0)
    # 1e-40: floor(log2) = -133, X would be 2^-135 but E8M0 stops at 2^-127: 1e-40/2^-127 = 0.017 → 0 in E2M1
    assert torch.equal(mx_quantize(torch.full((32,), 1e-40)), torch.zeros(32))
    # in E4M3 elements, 0.017 survives: 2^-127 · e4m3(1e-40 · 2^127)
    want = e4m3_reference(1e-40 * 2.0**127) * 2.0**-127
    got = mx_quantize(torch.full((32,), 1e-40), "fp8_e4m3")
    assert torch.allclose(got, torch.tensor(want), rtol=1e-6, atol=0) and got[0] > 0


def test_mxfp8_hand_worked_blocks() -> None:
    # amax 448 → X = 2^(8-8) = 1 → plain E4M3 rounding
    x = _block([448.0, 3.3, -100.0, 0.001])
    want = _block([448.0, e4m3_reference(3.3), -96.0, e4m3_reference(0.001)])
    torch.testing.assert_close(mx_quantize(x, "fp8_e4m3"), want, rtol=0, atol=0)
    # amax 500 → X = 2^(8-8) = 1 → 500 saturates at 448 (FLOOR scale)
    torch.testing.assert_close(mx_quantize(_block([500.0]), "fp8_e4m3"), _block([448.0]), rtol=0, atol=0)
    # amax 1 → X = 2^-8 (E4M3) or 2^-15 (E5M2): 1.0 exact, 0.3 → nearest element value
    e4m3 = mx_quantize(_block([1.0, 0.3]), "fp8_e4m3")
    torch.testing.assert_close(e4m3, _block([1.0, e4m3_reference(0.3 * 256) / 256]), rtol=1e-7, atol=0)
    e5m2 = mx_quantize(_block([1.0, 0.3]), "fp8_e5m2")
    torch.testing.assert_close(e5m2, _block([1.0, 0.3125]), rtol=0, atol=0)  # 2 mantissa bits: 0.3 → 1.25·2^-2


def test_mx_nan_inf_and_errors() -> None:
    # Inf saturates to 6·X with X from the finite amax 3 (X = 0.5); NaN stays in its element only
    got = mx_quantize(_block([NAN, INF, -INF, 3.0, 1.0]))
    assert math.isnan(got[0])
    torch.testing.assert_close(got[1:5], torch.tensor([3.0, -3.0, 3.0, 1.0]), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"block_size=32 does not divide the last dimension \(48\)"):
        mx_quantize(torch.ones(48))
    with pytest.raises(ValueError, match="unknown MX element format"):
        mx_quantize(torch.ones(32), "int8")  # type: ignore[arg-type]
    assert mx_quantize(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


# --------------------------------------------------------------------------------------- SQNR
def heavy_tailed_weight(seed: int = 0, rows: int = 256, cols: int = 1024) -> torch.Tensor:
    """Student-t (3 d.o.f.) weights, row scales log-normal, four outlier rows ×20."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, cols, generator=generator)
    chi2 = torch.randn(3, rows, cols, generator=generator).pow(2).sum(0)
    weight = normal / torch.sqrt(chi2 / 3)
    weight *= torch.exp(0.5 * torch.randn(rows, 1, generator=generator))
    weight[torch.randperm(rows, generator=generator)[:4]] *= 20
    return weight


def test_sqnr_finer_granularity_is_better_for_int4() -> None:
    w = heavy_tailed_weight()
    per_tensor = sqnr_db(w, int_quantize(w, 4, granularity="tensor"))
    per_channel = sqnr_db(w, int_quantize(w, 4, granularity="channel"))
    group_128 = sqnr_db(w, int_quantize(w, 4, granularity="group", group_size=128))
    group_32 = sqnr_db(w, int_quantize(w, 4, granularity="group", group_size=32))
    assert group_32 > group_128 + 1.0 and group_128 > per_channel + 1.0 and per_channel > per_tensor + 1.0
    assert per_channel > 8.0  # int4 per channel on heavy tails: a sanity floor


def test_sqnr_fp8_shrugs_off_an_outlier_that_ruins_int8() -> None:
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(256, 1024, generator=generator)
    spiked = w.clone()
    spiked[7, 11] = 1000.0
    rest = torch.ones_like(w, dtype=torch.bool)
    rest[7, 11] = False

    def quality(quantize) -> tuple[float, float]:
        return sqnr_db(w, quantize(w)), sqnr_db(w[rest], quantize(spiked)[rest])

    fp8_clean, fp8_spiked = quality(lambda t: fp8_quantize(t))
    int8_clean, int8_spiked = quality(lambda t: int_quantize(t, 8, granularity="tensor"))
    assert fp8_clean - fp8_spiked < 3.0
    assert int8_clean - int8_spiked > 20.0
    assert fp8_spiked > int8_spiked + 15.0


# ----------------------------------------------------------------------------------- storage
def test_bits_per_element_known_answers() -> None:
    assert bits_per_element("int", bits=4, granularity="group", group_size=128) == 4.125
    assert bits_per_element("int", bits=4, granularity="group", group_size=128, symmetric=False) == 4.15625
    assert bits_per_element("int", bits=8, granularity="channel", in_features=4096) == 8 + 16 / 4096
    assert bits_per_element("nvfp4") == 4.5
    assert bits_per_element("nvfp4", in_features=256, out_features=128) == 4.5 + 32 / 32768
    assert bits_per_element("mxfp4") == 4.25
    assert bits_per_element("mxfp8") == 8.25
    assert bits_per_element("fp8_e4m3", granularity="tensor") == 8.0
    assert bits_per_element("fp8_e4m3", granularity="block") == 8 + 32 / 16384
    # 200×300 with 128×128 tiles: 2×3 tiles, partial edges counted
    assert bits_per_element("fp8_e4m3", granularity="block", in_features=300, out_features=200) == 8 + 6 * 32 / 60000
    with pytest.raises(ValueError, match="unknown format 'int3'"):
        bits_per_element("int3")
    with pytest.raises(ValueError, match="needs group_size"):
        bits_per_element("int", bits=4, granularity="group")
    with pytest.raises(ValueError, match="needs in_features"):
        bits_per_element("int", bits=4, granularity="channel")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_quantizer_gives_the_same_values_on_cuda_as_on_cpu() -> None:
    w = heavy_tailed_weight(rows=64, cols=256)
    w[3, 5], w[9, 1], w[10, 0] = NAN, INF, 1e-40
    quantizers = {
        "int4 g32 asym": lambda t: int_quantize(t, 4, symmetric=False, granularity="group", group_size=32),
        "int8 channel": lambda t: int_quantize(t, 8),
        "fp8 block": lambda t: fp8_quantize(t, granularity="block", block_shape=(32, 64)),
        "fp8 token e5m2": lambda t: fp8_quantize(t, "e5m2", granularity="token"),
        "nvfp4": nvfp4_quantize,
        "mxfp4": mx_quantize,
        "mxfp8": lambda t: mx_quantize(t, "fp8_e4m3"),
    }
    for name, quantize in quantizers.items():
        on_cpu, on_cuda = quantize(w), quantize(w.cuda())
        assert on_cuda.device.type == "cuda", name
        torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=1e-6, atol=0, equal_nan=True, msg=name)
