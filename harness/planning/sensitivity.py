"""Layer sensitivity: which layers do the damage when a scheme quantizes them?

Quantizes ONE unit at a time — one linear layer, or one decoder block's linears — with the
scheme's own method (weights and, for W8A8/W4A4, the unit's input quantization), scores the
KL(ref‖quant) it causes on the divergence texts against a reference scored once, then puts the
unit's parameters and module classes back exactly (bitwise) before the next one. The KV cache
is not part of a unit (it is not a layer's weights): KV settings are ignored here.

Mixture-of-experts layers: a layer's fused experts are quantized per expert
(:mod:`harness.quant.experts`), and their per-expert matrices ``<layer>.mlp.experts.<e>.<proj>`` belong to
the layer's block unit (``granularity=block``) or form one unit ``<layer>.mlp.experts`` per MoE layer
(``granularity=linear``); ``granularity=expert`` is the per-expert detail, one unit
``<layer>.mlp.experts.<e>`` per expert (one scoring pass each; for the table only: a scheme cannot keep part
of a fused experts module, so recommend takes block or linear). Routers are no unit: the units quantize no
router (``quant.moe.quantize_router`` counts only in the all-at-once measurement).

``python -m harness.sensitivity model=... quant=... slices=... [granularity=block|linear|expert] [texts=8] [out=DIR]``
writes ``sensitivity.csv`` (unit, linears, kl_mean, kl_max, top1_agree, ppl_ratio; most damaging
first), ``sensitivity.png`` (KL per unit in model order) and ``summary.json`` under
``<paths.results_dir>/sensitivity/<model>__<scheme>/``, and logs them to MLflow as artifacts of
a run tagged ``harness.kind=sensitivity``.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pandas as pd
import torch
from torch import nn

from harness import cli, quant
from harness.config import QuantConfig, RunConfig
from harness.divergence import scoring as divergence
from harness.errors import UsageError
from harness.infra.cache import atomic_write_json
from harness.quant import target_linears
from harness.quant.experts import expert_shapes, find_fused_experts, fuse_experts

log = logging.getLogger(__name__)

Granularity = Literal["linear", "block", "expert"]
GRANULARITIES = ("block", "linear", "expert")
KIND_TAG = "harness.kind"
TABLE_COLUMNS = ["unit", "linears", "kl_mean", "kl_max", "top1_agree", "ppl_ratio"]


def block_prefixes(model: nn.Module) -> list[str]:
    """Module names of the decoder blocks: the adapter's, else the longest ModuleList holding Linears."""
    from harness.quant.architectures import get_adapter
    try:
        adapter = get_adapter(model)
        return [adapter.block_name(i) for i in range(len(adapter.blocks(model)))]
    except ValueError:
        lists = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.ModuleList)
                 and any(isinstance(m, nn.Linear) for m in module.modules())]
        if not lists:
            raise ValueError(f"{type(model).__name__} has no ModuleList of blocks; use granularity=linear") from None
        name, blocks = max(lists, key=lambda item: len(item[1]))
        return [f"{name}.{i}" for i in range(len(blocks))]


def target_matrices(model: nn.Module, scheme: QuantConfig) -> dict[str, tuple[int, int]]:
    """Every matrix the scheme quantizes, name → (out, in), in model order: the target Linears, and each fused
    experts module's per-expert matrices (``<experts>.<e>.<proj>``, the Linears they become once unfused)."""
    linears = target_linears(model, scheme)[0]
    experts = expert_shapes(model, scheme)
    fused = find_fused_experts(model)
    out: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if name in linears:
            out[name] = (module.out_features, module.in_features)
        elif name in fused:
            out.update((n, experts[n]) for n in fused[name].expert_names() if n in experts)
    return out


def _experts_owner(name: str, fused: dict[str, Any], per_expert: bool) -> str | None:
    """The experts module (or, ``per_expert``, the expert ``<experts>.<e>``) a per-expert matrix belongs to."""
    module = next((m for m in fused if name.startswith(m + ".")), None)
    if module is None or not per_expert:
        return module
    return f"{module}.{name[len(module) + 1:].split('.', 1)[0]}"


def sensitivity_units(model: nn.Module, scheme: QuantConfig, granularity: Granularity) -> dict[str, list[str]]:
    """Unit name → the target matrices it quantizes (Linears and per-expert matrices), in model order."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}: use 'linear', 'block' or 'expert'")
    targets = list(target_matrices(model, scheme))
    fused = find_fused_experts(model)
    units: dict[str, list[str]] = {}
    if granularity in ("linear", "expert"):
        for name in targets:
            units.setdefault(_experts_owner(name, fused, granularity == "expert") or name, []).append(name)
        return units
    prefixes = block_prefixes(model)
    for name in targets:
        owner = next((p for p in prefixes if name.startswith(p + ".")), None)
        owner = owner or _experts_owner(name, fused, False) or name  # outside blocks: alone (experts as one)
        units.setdefault(owner, []).append(name)
    return units


def unit_scheme(scheme: QuantConfig, linears: list[str], model: nn.Module | None = None) -> QuantConfig:
    """The scheme restricted to exactly these matrices (by full name), without KV-cache quantization.

    Quantizing one unit leaves the rest of the model unquantized on purpose, so the unit's scheme allows
    uncovered weights, and quantizes no router. With ``model``, a unit holding every matrix of a fused
    experts module (all of them selected by the scheme) names them by one pattern ``<experts>.*``: hundreds
    of exact names per layer would make each target match slow on a 128-expert model.
    """
    unit = copy.deepcopy(scheme)
    unit.targets = _compress(scheme, linears, model) if model is not None else list(linears)
    unit.kv_cache = None
    unit.allow_uncovered = True
    if getattr(unit, "moe", None) is not None:
        unit.moe.quantize_router = False
    return unit


def _compress(scheme: QuantConfig, linears: list[str], model: nn.Module) -> list[str]:
    """``linears`` as target patterns: ``<experts>.*`` for a fused experts module whose every matrix is in the
    unit and selected by the scheme (then the pattern selects exactly them), exact names for the rest."""
    fused = find_fused_experts(model)
    if not fused:
        return list(linears)
    selected = set(expert_shapes(model, scheme))
    groups: dict[str, list[str]] = {}
    for name in linears:
        groups.setdefault(_experts_owner(name, fused, False) or name, []).append(name)
    patterns: list[str] = []
    for owner, names in groups.items():
        whole = owner in fused and set(names) == set(fused[owner].expert_names()) <= selected
        patterns += [f"{owner}.*"] if whole else names
    return patterns


def _scope(linears: list[str], prefixes: list[str], fused: dict[str, Any] | None = None) -> str:
    """The smallest module a unit's method may touch: its block (norms absorb SmoothQuant/AWQ scales), else
    its fused experts module, else the linear itself."""
    block = next((p for p in prefixes if linears[0].startswith(p + ".")), None)
    return block or _experts_owner(linears[0], fused or {}, False) or linears[0]


class _Snapshot:
    """Parameters and module classes of one scope, restored bitwise after a unit is scored."""

    def __init__(self, module: nn.Module):
        self.modules = [(m, m.__class__) for m in module.modules()]
        self.params = [(p, p.data.clone()) for p in module.parameters()]

    def restore(self) -> None:
        for module, cls in self.modules:
            if module.__class__ is not cls:  # e.g. ActQuantLinear installed by apply()
                module.__class__ = cls
                module._buffers.pop("input_scale", None)
                for attribute in ("spec", "_input_cache"):
                    module.__dict__.pop(attribute, None)
        for param, saved in self.params:
            param.data = saved


def restore(model: nn.Module, snapshot: _Snapshot) -> None:
    """Put the model back: experts an activation scheme left unfused are fused back first (their modules
    return), then the snapshot's parameters and classes."""
    fuse_experts(model)
    snapshot.restore()


class _Uncached:
    """A calibration context without its cache: one unit's calibrated weights are not worth storing."""

    cache = None

    def __init__(self, context: Any):
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _score(frame: pd.DataFrame) -> dict[str, float]:
    return {
        "kl_mean": float(frame["kl"].mean()),
        "kl_max": float(frame["kl"].max()),
        "top1_agree": float((frame["top1_ref"] == frame["top1_quant"]).mean()),
        "ppl_ratio": math.exp(float(frame["nll_quant"].mean() - frame["nll_ref"].mean())),
    }


@torch.no_grad()
def layer_sensitivity(model: nn.Module, scheme: QuantConfig, reference: list[divergence.ReferenceText], *,
                      granularity: Granularity = "block", context: Any = None) -> pd.DataFrame:
    """KL(ref‖quant) when each unit alone is quantized; most damaging first. ``model`` is left as it was."""
    units = sensitivity_units(model, scheme, granularity)
    if not units:
        raise ValueError(f"scheme {scheme.name!r} quantizes no linear of this model; nothing to rank")
    try:
        prefixes = block_prefixes(model)
    except ValueError:
        prefixes = []  # no blocks: each linear is its own scope
    fused = find_fused_experts(model)
    rows = []
    start = time.perf_counter()
    for index, (unit, linears) in enumerate(units.items()):
        snapshot = _Snapshot(model.get_submodule(_scope(linears, prefixes, fused)))
        try:
            quant.apply(model, unit_scheme(scheme, linears, model), None if context is None else _Uncached(context))
            scores = _score(divergence.compare_to_reference(model, reference, "sensitivity"))
        finally:
            restore(model, snapshot)
        rows.append({"unit": unit, "linears": len(linears), **scores})
        log.info("sensitivity %d/%d %s: KL %.5f (%.0fs)", index + 1, len(units), unit, scores["kl_mean"],
                 time.perf_counter() - start)
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    table["order"] = range(len(table))  # model order, for the plot
    return table.sort_values("kl_mean", ascending=False, kind="stable").reset_index(drop=True)


def plot_sensitivity(table: pd.DataFrame, path: Path, title: str) -> None:
    """Bar per unit in model order; the five most damaging are labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = table.sort_values("order")
    width = min(max(7.0, 0.12 * len(ordered) + 2), 24.0)
    fig, ax = plt.subplots(figsize=(width, 4.0))
    ax.bar(range(len(ordered)), ordered["kl_mean"], color="#4c72b0")
    top = set(table["unit"].head(5))
    for x, (unit, kl) in enumerate(zip(ordered["unit"], ordered["kl_mean"])):
        if unit in top:
            ax.annotate(unit.replace("model.layers.", "L"), (x, kl), rotation=60, fontsize=7,
                        ha="left", va="bottom", xytext=(0, 2), textcoords="offset points")
    ax.set_xlabel("unit (model order)")
    ax.set_ylabel("mean KL(ref‖quant), nats/token")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- CLI
@dataclass
class SensitivityResult:
    table: pd.DataFrame
    summary: dict[str, Any]
    directory: Path


def reference_texts(loaded: Any, cfg: RunConfig, n_texts: int) -> list[divergence.ReferenceText]:
    """The reference pass over the selected slices' divergence texts (``n_texts`` in all, spread over slices)."""
    from harness.evaluation.slices import resolve
    from harness.job import divergence_texts, identity

    slices = resolve(cfg.slices)
    spec = identity.ReferenceSpec.of(cfg)
    settings = spec.eval_settings(identity.tokenizer_dir(loaded))
    per_slice = max(1, math.ceil(n_texts / len(slices)))
    scored: list[divergence.ReferenceText] = []
    for slice_ in slices:
        texts = divergence_texts.divergence_texts(slice_, settings)[:per_slice]
        scored += divergence.score_reference(loaded.model, loaded.tokenizer, texts,
                                             max_tokens=divergence_texts.max_divergence_tokens(slice_, spec))
    if not scored:
        raise ValueError(f"the slices {list(cfg.slices)} give no divergence texts; pick an offline slice (slices=math)")
    return scored[:n_texts]


def run_sensitivity(cfg: RunConfig, granularity: Granularity = "block", n_texts: int = 8,
                    directory: Path | None = None) -> SensitivityResult:
    """Load, score the reference once, rank the units, write csv/png/summary and log them to MLflow."""
    from harness.sizing.report_quant import output_dir, prepare

    start = time.perf_counter()
    prepared = prepare(cfg)
    model = prepared.loaded.model
    reference = reference_texts(prepared.loaded, cfg, n_texts)
    table = layer_sensitivity(model, prepared.scheme, reference, granularity=granularity, context=prepared.context)
    snapshot = _Snapshot(model)  # the whole scheme at once, for scale (routers too, if the scheme quantizes them)
    whole = copy.deepcopy(prepared.scheme)
    whole.kv_cache = None
    try:
        quant.apply(model, whole, prepared.context)
        all_layers = _score(divergence.compare_to_reference(model, reference, "sensitivity"))
    finally:
        restore(model, snapshot)
    directory = directory or output_dir(cfg, "sensitivity")
    directory.mkdir(parents=True, exist_ok=True)
    summary = {"model": cfg.model.name, "scheme": cfg.quant.name, "method": cfg.quant.method,
               "granularity": granularity, "units": len(table), "texts": len(reference),
               "tokens": int(sum(len(r.input_ids) - 1 for r in reference)), "slices": list(cfg.slices),
               "all_layers": all_layers, "kl_sum_of_units": float(table["kl_mean"].sum()),
               "most_damaging": table["unit"].head(5).tolist(), "seconds": time.perf_counter() - start}
    table.drop(columns="order").to_csv(directory / "sensitivity.csv", index=False)
    plot_sensitivity(table, directory / "sensitivity.png",
                     f"{cfg.model.name} · {cfg.quant.name}: KL when one {granularity} alone is quantized\n"
                     f"(all {len(table)} at once: {all_layers['kl_mean']:.4f}; {len(reference)} texts)")
    atomic_write_json(directory / "summary.json", summary)
    if cfg.tracking.enabled:
        _track_sensitivity(directory, cfg, summary)
    return SensitivityResult(table.drop(columns="order"), summary, directory)


def _track_sensitivity(directory: Path, cfg: RunConfig, summary: dict[str, Any]) -> None:
    from harness.results import tracking

    tracking.log_tool_run(
        directory, uri=cfg.tracking.uri, experiment=cfg.tracking.experiment, kind="sensitivity",
        run_name=f"sensitivity/{cfg.model.name}/{cfg.quant.name}/{summary['granularity']}",
        tags={"model": cfg.model.name, "scheme": cfg.quant.name, **cfg.tracking.tags},
        params={"granularity": summary["granularity"], "texts": summary["texts"], "tokens": summary["tokens"],
                "slices": ",".join(summary["slices"]), "method": summary["method"]},
        metrics={"all_layers/kl_mean": summary["all_layers"]["kl_mean"],
                 "all_layers/top1_agree": summary["all_layers"]["top1_agree"],
                 "kl_sum_of_units": summary["kl_sum_of_units"]})


@dataclass
class SensitivityOptions:
    granularity: str = field(default="block", metadata={"help": "unit quantized alone: block | linear (a MoE "
                                                                 "layer's experts as one) | expert (each expert)"})
    texts: int = field(default=8, metadata={"help": "divergence texts scored per unit"})
    out: Optional[str] = field(default=None, metadata={"help": "output directory (None: "
                                                               "<paths.results_dir>/sensitivity/<model>__<scheme>)"})


TOOL = cli.Tool(prog="python -m harness.sensitivity", options=SensitivityOptions, run_config=True,
                summary="KL(ref||quant) caused by quantizing one decoder block, linear or expert at a time with the scheme "
                        "(model=... quant=... slices=...); most damaging first.")


def _sensitivity(parsed: cli.Parsed[SensitivityOptions]) -> None:
    options = parsed.options
    if options.granularity not in GRANULARITIES:
        raise UsageError(f"granularity={options.granularity!r}: use granularity=block or granularity=linear")
    if options.texts < 1:
        raise UsageError(f"texts={options.texts}: score at least one divergence text (texts=8)")
    result = run_sensitivity(parsed.run, options.granularity, options.texts,  # type: ignore[arg-type]
                             Path(options.out) if options.out else None)
    print(result.table.to_markdown(index=False, floatfmt=".4g"))
    print(json.dumps({k: v for k, v in result.summary.items() if k != "most_damaging"}, indent=1))


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _sensitivity, argv)


if __name__ == "__main__":
    sys.exit(main())
