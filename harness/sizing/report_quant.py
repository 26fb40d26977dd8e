"""``python -m harness.report_quant model=... quant=... [gpus=H100,H200,B200] [out=DIR]`` — what a scheme does to the weights.

Loads the model, applies the scheme and reports, per quantized linear, the SQNR and relative RMS
error of its weights, then the bits per weight including scales, the model's weight size in GB
and the batch-1 decode floor: decode reads every weight once per token, so time per token is at
least weight bytes ÷ memory bandwidth. The floor is given for this model and, at the same bits
per weight, for nominal 8B and 70B models (the quantization primers' table: 70B in BF16 is
140 GB, 41.8 ms/token on an H100's 3.35 TB/s). Tables are written as Markdown and CSV under
``<paths.results_dir>/quant_report/<model>__<scheme>/``.

The command line follows :mod:`harness.cli`: the tool's own options (:class:`ReportQuantOptions`)
and the run's own overrides (same config as ``python -m harness``); ``gpus=`` takes names from
:data:`GPU_BANDWIDTH` or ``NAME=TB/s`` pairs, ``runtime.threads=N`` sets torch's CPU threads.
"""
from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from harness import cli, quant
from harness.config import RunConfig
from harness.errors import UsageError
from harness.infra.cache import Cache, atomic_write_text
from harness.models import loading as models
from harness.quant import QuantReport
from harness.results.report import coverage_lines
from harness.sizing.ledger import (  # noqa: F401 (re-exported)
    DEFAULT_GPUS,
    EXTRAPOLATE_PARAMS,
    GPU_BANDWIDTH,
    REFERENCE_BITS,
    decode_floor_metrics,
    decode_floor_ms,
    decode_floor_table,
)

log = logging.getLogger(__name__)

def layer_table(report: QuantReport) -> pd.DataFrame:
    """One row per quantized linear: shape, bits per weight (scales included), SQNR, relative RMS error."""
    columns = ["name", "out_features", "in_features", "bits_per_weight", "sqnr_db", "rel_rms"]
    return pd.DataFrame(report.to_records(), columns=columns)


def parse_gpus(spec: str) -> dict[str, float]:
    """``"H100,H200,X=2.5"`` → name → bytes/s (known names from GPU_BANDWIDTH; ``NAME=TB/s`` for others)."""
    gpus: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if "=" in item:
            name, value = item.split("=", 1)
            try:
                gpus[name.strip()] = float(value) * 1e12
            except ValueError:
                raise UsageError(f"gpus={spec}: bandwidth of {item!r} must be a number of TB/s, "
                                     "e.g. H100=3.35") from None
        elif item in GPU_BANDWIDTH:
            gpus[item] = GPU_BANDWIDTH[item]
        else:
            raise UsageError(f"gpus={spec}: unknown GPU {item!r}; known {', '.join(sorted(GPU_BANDWIDTH))}, "
                                 "or give NAME=TB/s")
    if not gpus:
        raise UsageError(f"gpus={spec!r} selects no GPU; e.g. gpus=H100,H200")
    return gpus


# ------------------------------------------------------------------------ model + scheme, shared
@dataclass
class Prepared:
    loaded: models.LoadedModel
    scheme: Any  # QuantConfig with the model's defaults filled in
    context: Any  # CalibrationContext


def prepare(cfg: RunConfig) -> Prepared:
    """Check the scheme, load the model and build its calibration context (no quantization yet)."""
    from harness.infra.devices import calibration_device
    from harness.infra.runtime import apply_threads
    from harness.quant.calibration import CalibrationContext, check_format

    apply_threads(cfg.runtime)
    scheme = quant.with_model_defaults(cfg.quant, cfg.model.ragged_groups)
    quant.validate_scheme(scheme)
    check_format(scheme.calibration, cfg.model.chat_template, cfg.model.name)
    models.check_available(cfg.model)
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    quant.validate_for_model(loaded.model, scheme)
    context = CalibrationContext(model_key=loaded.key, tokenizer=loaded.tokenizer, config=scheme.calibration,
                                 device=calibration_device(loaded.model, cfg.model.device),
                                 cache=Cache(cfg.paths.cache_dir), scheme=scheme,
                                 chat_template=cfg.model.chat_template)
    return Prepared(loaded, scheme, context)


def output_dir(cfg: RunConfig, kind: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{cfg.model.name}__{cfg.quant.name}")
    return Path(cfg.paths.results_dir) / kind / safe


# ---------------------------------------------------------------------------------- the report
@dataclass
class QuantReportTables:
    summary: dict[str, Any]
    layers: pd.DataFrame
    decode_floor: pd.DataFrame
    directory: Path

    def markdown(self) -> str:
        s = self.summary
        lines = [
            f"# Quantization report: {s['model']} · {s['scheme']} ({s['method']})", "",
            f"- quantized linears: {s['layers_quantized']} ({s['quantized_fraction']:.1%} of {s['total_params']:,} "
            f"parameters); kept in high precision: {', '.join(s['kept']) or 'none'}",
            f"- bits per weight of the linears (scales included; kept ones at 16, the output head left out): "
            f"{s['bits_per_weight']:.4f}",
            f"- bits per parameter over the whole model (kept layers at 16): {s['bits_per_param_total']:.4f}",
            *(f"- {line}" for line in coverage_lines({"quant": s})),
            *(f"- experts that fell back to round-to-nearest (too few routed calibration tokens): "
              f"{s['moe_fallback_experts']}" for _ in [0] if s.get("moe_fallback_experts")),
            f"- weight size: {s['weight_gb']:.4f} GB (BF16: {s['bf16_gb']:.4f} GB)",
            f"- weight SQNR: mean {s['sqnr_db_mean']:.2f} dB, min {s['sqnr_db_min']:.2f} dB; "
            f"quantized in {s['quantize_s']:.2f} s",
            *(f"- note: {note}" for note in s["notes"]),
            "", "## Batch-1 decode floor (weight bytes ÷ memory bandwidth)", "",
            _floor_markdown(self.decode_floor), "",
            "8B/70B rows: all parameters at the scheme's bits per weight above (nominal 8e9 / 70e9 parameters, "
            "each read per token); this model's rows gather an untied input embedding.",
            "", "## Coverage account", "",
            pd.DataFrame(s["coverage"]["rows"]).to_markdown(index=False, floatfmt=".4g") if s.get("coverage") else "",
            "", "## Per-layer weight error", "",
            self.layers.to_markdown(index=False, floatfmt=".4g") if len(self.layers) else "(no quantized weights)",
        ]
        return "\n".join(lines) + "\n"


def _floor_markdown(table: pd.DataFrame) -> str:
    shown = table.copy()
    shown["params"] = shown["params"].map(lambda p: f"{p / 1e9:.3g}B")
    return shown.to_markdown(index=False, floatfmt=".4g")


def build_tables(report: QuantReport, *, model_name: str, gpus: dict[str, float], directory: Path) -> QuantReportTables:
    summary = report.summary()
    summary.update({"model": model_name, "scheme": report.scheme, "method": report.method, "kept": list(report.kept),
                    "total_params": report.total_params, "notes": list(report.notes),
                    "bf16_gb": report.total_params * REFERENCE_BITS / 8 / 1e9})
    return QuantReportTables(summary, layer_table(report), decode_floor_table(report, gpus, model_name=model_name),
                             directory)


def write_tables(tables: QuantReportTables) -> None:
    tables.directory.mkdir(parents=True, exist_ok=True)
    tables.layers.to_csv(tables.directory / "layers.csv", index=False)
    tables.decode_floor.to_csv(tables.directory / "decode_floor.csv", index=False)
    atomic_write_text(tables.directory / "report.md", tables.markdown())


def report_quant(cfg: RunConfig, gpus: dict[str, float] | None = None, directory: Path | None = None) -> QuantReportTables:
    """Load, quantize and tabulate; writes report.md, layers.csv and decode_floor.csv."""
    gpus = {name: GPU_BANDWIDTH[name] for name in DEFAULT_GPUS} if gpus is None else gpus
    prepared = prepare(cfg)
    report = quant.apply(prepared.loaded.model, prepared.scheme, prepared.context)
    tables = build_tables(report, model_name=cfg.model.name, gpus=gpus,
                          directory=directory or output_dir(cfg, "quant_report"))
    write_tables(tables)
    log.info("quantization report written to %s", tables.directory)
    return tables


@dataclass
class ReportQuantOptions:
    gpus: str = field(default=",".join(DEFAULT_GPUS),
                      metadata={"help": f"GPUs of the decode-floor columns: {', '.join(sorted(GPU_BANDWIDTH))} "
                                        "or NAME=TB/s, comma-separated"})
    out: Optional[str] = field(default=None, metadata={"help": "output directory (None: "
                                                               "<paths.results_dir>/quant_report/<model>__<scheme>)"})


TOOL = cli.Tool(prog="python -m harness.report_quant", options=ReportQuantOptions, run_config=True,
                summary="Per-layer weight error, bits per weight, size and batch-1 decode floor of a scheme "
                        "(model=... quant=...; nothing is evaluated).")


def _report(parsed: cli.Parsed[ReportQuantOptions]) -> None:
    options = parsed.options
    gpus = parse_gpus(options.gpus)  # a bad GPU name fails before the model loads
    tables = report_quant(parsed.run, gpus, Path(options.out) if options.out else None)
    print(tables.markdown())


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _report, argv)


if __name__ == "__main__":
    sys.exit(main())
