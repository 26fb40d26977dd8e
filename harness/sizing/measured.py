"""The capacity ledger's prediction beside what an engine measured (:mod:`harness.engines.perf`): per side, the
ledger's weight memory and batch-1 decode floor (:mod:`harness.sizing.ledger`) beside the engine log's weight memory
and the measured time per output token, with their ratios. Here, not in the engine layer, because it reads the
ledger, which sits above the engines."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from harness.engines.perf import measured_weight_gb

__all__ = ["describe_run", "predicted_vs_measured"]


def _device_bandwidth(device: str) -> tuple[str, float]:
    """(GPU name, bytes/s) of a device as ``nvidia-smi`` names it (a ledger GPU's name inside it) or as
    ``NAME:memory_GB:bandwidth_TBps``; ("", nan) where neither (a CPU: the ledger predicts for GPUs)."""
    from harness.sizing.ledger import GPU_BANDWIDTH, resolve_gpus

    if device.count(":") == 2:
        (gpu,) = resolve_gpus([device])
        return gpu.name, gpu.bandwidth_tbs * 1e12
    for name in sorted(GPU_BANDWIDTH, key=len, reverse=True):
        if name.lower() in device.lower():
            return name, GPU_BANDWIDTH[name]
    return "", math.nan


def _ledger_bytes(summary: dict) -> dict[str, tuple[float, float]] | None:
    """side -> (weight bytes, bytes one batch-1 decode step reads) as the run's ledger predicted them
    (:func:`harness.sizing.ledger.decode_floor_table`, in summary.json's ``quant``); None without a ledger."""
    from harness.sizing.ledger import GPU_BANDWIDTH, REFERENCE_BITS

    quant = summary.get("quant") or {}
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(summary.get("model", "")))
    weight_gb = quant.get(f"decode_floor/{name}/weight_gb")
    floors = [(gpu, quant[f"decode_floor/{name}/{gpu}_ms"]) for gpu in GPU_BANDWIDTH
              if f"decode_floor/{name}/{gpu}_ms" in quant]
    params = (quant.get("coverage") or {}).get("total_params")
    if params is None and quant.get("bits_per_param_total"):
        params = weight_gb * 1e9 * 8 / quant["bits_per_param_total"] if weight_gb is not None else None
    if weight_gb is None or not floors or not params:
        return None
    gpu, floor_ms = floors[0]
    weight, read = weight_gb * 1e9, floor_ms / 1e3 * GPU_BANDWIDTH[gpu]
    gathered = weight - read  # an untied input embedding's rows decode does not read, kept at 16 bits on both sides
    reference = params * REFERENCE_BITS / 8
    return {"candidate": (weight, read), "reference": (reference, reference - gathered)}


def predicted_vs_measured(result: dict, summary: dict, device: str | None = None) -> list[dict[str, Any]]:
    """Per side (candidate: the scheme, reference: BF16), the ledger's weight memory and batch-1 decode floor beside
    what the engine showed: its log's weight memory (:func:`measured_weight_gb`) and the time per output token (TPOT
    p50) at the lowest concurrency measured, each with measured ÷ predicted. The floor is computed for ``device``
    (default: the result's ``device``); on a device the ledger has no bandwidth for, it stays empty."""
    predicted = _ledger_bytes(summary)
    if predicted is None or not result.get("levels"):
        return []
    device = device or str(result.get("device") or "")
    gpu, bandwidth = _device_bandwidth(device)
    level = min(result["levels"], key=lambda entry: entry["concurrency"])
    rows = []
    for side in ("candidate", "reference"):
        weight, read = predicted[side]
        measured, what = measured_weight_gb((result.get("log") or {}).get(side) or {})
        floor = read / bandwidth * 1e3 if math.isfinite(bandwidth) else math.nan
        tpot = 1e3 * level[side].get("tpot_p50", math.nan)
        rows.append({"side": side, "predicted_weight_gb": weight / 1e9, "measured_weight_gb": measured,
                     "measured_weight_from": what, "weight_ratio": measured / (weight / 1e9),
                     "device": device or "unknown", "gpu": gpu, "predicted_floor_ms": floor,
                     "measured_tpot_ms": tpot, "tpot_concurrency": level["concurrency"], "decode_ratio": tpot / floor})
    return rows


def describe_run(result: dict, run_dir: str | Path, device: str | None = None) -> dict:
    """``result`` with the run it measured (``run``: the simulation's results directory, ``model``, ``scheme``)
    and the ledger beside the measurement (``predicted``, :func:`predicted_vs_measured`), so that
    ``python -m harness.compare perf=[...]`` finds its run and the tables show both."""
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    result.update({"run": str(Path(run_dir).resolve()), "model": summary.get("model"), "scheme": summary.get("scheme"),
                   "predicted": predicted_vs_measured(result, summary, device)})
    return result
