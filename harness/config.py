"""Typed configuration schemas, registered with Hydra's ConfigStore.

Every YAML file under ``conf/`` is validated against these dataclasses when the config
is composed, so a misspelt key or a value of the wrong type fails at start-up, before a
model is loaded. One short comment per field says what changes when you flip it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class TinyModelConfig:
    """Shape of the random-weight llama-style model built for fast tests."""

    hidden_size: int = 128  # a multiple of 128 so group-128 schemes apply
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # < heads exercises grouped-query attention
    vocab_size: int = 0  # 0: use the tokenizer's vocabulary size
    tokenizer: str = "smollm2_135m"  # a packaged model whose tokenizer is borrowed
    seed: int = 0  # weights are a pure function of this seed


@dataclass
class ModelConfig:
    name: str = MISSING  # short name used in run names, tags and cache keys
    source: str = "hf"  # hf (hub id or local dir) | gguf_package | tiny_random
    path: str = ""  # hf: hub id or local directory; gguf_package: package name
    gguf_file: Optional[str] = None  # file inside the package (gguf_package only)
    revision: Optional[str] = None  # hub revision (pin it for reproducible sweeps)
    dtype: str = "float32"  # float32 on CPU; bfloat16 on GPU (bf16 is ~5x slower on CPU)
    # cpu | cuda | cuda:N | auto. An unindexed cuda becomes cuda:0 here, once (harness.infra.devices.normalize);
    # auto loads through accelerate's device_map="auto": layers spread over the visible GPUs, the rest
    # offloaded to CPU RAM (then disk) past max_memory.
    device: str = "cpu"
    # device=auto only: accelerate's per-device budget, e.g. {"0": 70GiB, "1": 70GiB, cpu: 200GiB} (GPU indices
    # quoted: keys are strings); empty: all free
    # memory of every visible GPU (and CPU offload beyond it).
    max_memory: dict[str, str] = field(default_factory=dict)
    chat_template: bool = True  # instruct models need their chat template
    max_length: int = 8192  # context window used for truncation and long-context buckets
    batch_size: int = 8  # lm-eval batch size; padding does not change answers (tested)
    trust_remote_code: bool = False
    # Default of quant.*.ragged_groups for this model: whether a group size that does not divide a
    # layer's input size is allowed (shorter last group) or refused as a config error.
    ragged_groups: bool = False
    tiny: Optional[TinyModelConfig] = None  # only for source=tiny_random
    # How the model thinks before it answers (harness.evaluation.thinking): none (every reply is an answer) | tags
    # (a trace between think_start and think_end, the answer after it) | harmony (gpt-oss: analysis, then final channel)
    thinking: str = "none"
    # The trace's opening tag (thinking=tags); a chat template that opens it at the end of the prompt counts (R1)
    think_start: str = "<think>"
    # The tag the answer follows (thinking=tags); a reply that never writes it is an unclosed trace, scored wrong
    think_end: str = "</think>"
    # Passed as enable_thinking to the chat template of both sides (Qwen3); null: not passed (the template's default)
    enable_thinking: Optional[bool] = None

    def __post_init__(self) -> None:
        from harness.infra.devices import normalize
        self.device = normalize(self.device)  # pure string work: no CUDA call at config time


@dataclass
class CandidateConfig:
    """An externally quantized checkpoint evaluated instead of the harness's own quantization
    (``quant=external candidate.path=...``; see harness/checkpoint/candidate.py for the formats)."""

    path: Optional[str] = None  # hub id or local directory; None: the harness quantizes as quant= says
    gguf_file: Optional[str] = None  # a .gguf file inside `path` (a directory or an installed package)
    revision: Optional[str] = None  # hub revision of the candidate
    name: Optional[str] = None  # label in run names and MLflow; default: the path's last part
    trust_remote_code: bool = False
    # A served candidate (harness.engines.served): an OpenAI-compatible /v1/completions server answers
    # the items instead of an in-process model, paired with the reference as any candidate (quant=external).
    endpoint: Optional[str] = None  # a running server's base URL, e.g. http://127.0.0.1:8000 (no credentials in it)
    serve: Optional[str] = None  # or a command the harness starts on a free loopback port, with {port} in it
    endpoint_model: Optional[str] = None  # the served model's id; None: the server's only model
    endpoint_api_key_env: Optional[str] = None  # NAME of the environment variable holding the API key, never the key
    endpoint_timeout_s: float = 600.0  # one request; a server silent for longer counts as hung
    endpoint_batch_size: int = 8  # prompts per log-likelihood request
    # generation requests in flight at once, so that the engine can batch them (1: one at a time, as lm-eval
    # sends them; more is faster on an engine, and its replies may then depend on how it batched them)
    endpoint_concurrency: int = 1
    endpoint_max_requests_per_s: Optional[float] = None  # the server's rate limit, requests started per second (null: none)
    # log-probs asked per position of the divergence texts: KL on the server's top-k partition, a lower bound of the
    # exact KL that tightens as k grows (vLLM returns at most --max-logprobs, 20 by default); 0: no token divergence
    endpoint_divergence_topk: int = 20
    serve_startup_s: float = 900.0  # how long candidate.serve may take to answer /health


@dataclass
class TensorQuantConfig:
    """How one kind of tensor (weights, activations, keys, values) is quantized."""

    format: str = "int"  # int | fp8_e4m3 | fp8_e5m2 | nvfp4 | mxfp4 | mxfp8 (table in harness.quant.format_table)
    bits: int = 8  # int only
    symmetric: bool = True  # int only; asymmetric adds a zero point per group
    # int, symmetric only: restricted (scale amax/(2^(b-1)-1), codes ±(2^(b-1)-1), the harness's default)
    # | full (compressed-tensors / llm-compressor: scale amax/((2^b-1)/2), codes -2^(b-1)..2^(b-1)-1)
    int_range: str = "restricted"
    granularity: str = "channel"  # tensor | channel | group | token | block | head
    group_size: int = 128  # for granularity=group
    block_shape: list[int] = field(default_factory=lambda: [128, 128])  # for block (fp8)
    dynamic: bool = True  # activations/KV: scale per call (True) or calibrated once (False)
    scale_bits: int = 16  # storage of each scale in bits-per-weight accounting
    # Allow a shorter last group when group_size does not divide a layer's input size (the GPTQ
    # reference's behaviour; kernels such as Marlin need divisibility). None: the model's default.
    ragged_groups: Optional[bool] = None


@dataclass
class KVCacheQuantConfig:
    keys: Optional[TensorQuantConfig] = None  # keys are quantized after RoPE
    values: Optional[TensorQuantConfig] = None
    residual_length: int = 0  # KIVI: most recent tokens kept in full precision
    group_tokens: int = 32  # KIVI per-channel keys: scales shared over groups of tokens


@dataclass
class CalibrationConfig:
    # The calibration text's domain: prose (= offline, the default: stdlib docstrings) | code | multilingual | math
    # (offline, built from installed packages; harness.quant.calibration_sources) | dataset (below). The default's value
    # stays "offline" so run keys of existing results are unchanged.
    source: str = "offline"
    dataset: Optional[str] = None  # datasets name, e.g. wikitext (cluster runs)
    dataset_config: Optional[str] = None
    split: str = "train"
    text_field: str = "text"
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    # How each sample is laid out: chat (user turn + assistant reply in the model's chat template, the
    # format it is evaluated and served in) | plain (raw text windows) | auto (chat when model.chat_template)
    format: str = "auto"


@dataclass
class MoEQuantConfig:
    """``quant.moe``: how mixture-of-experts layers are quantized (harness.quant.experts; ignored by dense models)."""

    # Calibrate every expert on every calibration token (llm-compressor's choice) instead of the tokens the
    # router sends to it; the block's output still uses only the routed experts.
    calibrate_all_experts: bool = False
    # An expert whose calibration statistics come from fewer routed tokens than this is rounded to nearest on
    # the same grid instead of solved by GPTQ/AWQ; counted in the quant report (moe.fallback_experts).
    min_tokens: int = 16
    quantize_router: bool = False  # routers (mlp.gate) stay in full precision unless true (then rounded as a Linear)


@dataclass
class QuantConfig:
    name: str = MISSING  # scheme name used in run names and tags
    method: str = "rtn"  # rtn | gptq | awq | smoothquant, or one a plugin registers (harness.quant.register_method)
    # Modules imported before the scheme is checked; each registers methods or number formats on import.
    plugins: list[str] = field(default_factory=list)
    # The method's settings (quant.settings.damp_percent=0.05 for gptq), checked against the settings dataclass
    # its registration names (harness.quant.register_method); unset keys take that dataclass's defaults
    settings: dict[str, Any] = field(default_factory=dict)
    weights: Optional[TensorQuantConfig] = None  # None: weights stay in high precision
    activations: Optional[TensorQuantConfig] = None  # None: weight-only (W*A16)
    kv_cache: Optional[KVCacheQuantConfig] = None  # None: full-precision KV cache
    targets: list[str] = field(default_factory=lambda: ["*"])  # fnmatch patterns of Linear names
    keep: list[str] = field(default_factory=lambda: ["lm_head", "*embed*"])  # left in high precision
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    moe: MoEQuantConfig = field(default_factory=MoEQuantConfig)
    # A scheme that would leave a matrix-shaped weight unquantized that no rule keeps (embedding, norm, router,
    # output head, quant.keep) is refused before any evaluation (harness.quant.coverage); true runs it anyway
    # and puts the uncovered share in the run's headline.
    allow_uncovered: bool = False


@dataclass
class SliceConfig:
    tasks: list[str] = MISSING  # lm-eval task names (offline tasks under slices/, or registry)
    registry: bool = False  # tasks come from lm-eval's registry and need the dataset hub
    size: str = "${eval.size}"  # quick | full (offline item counts; see slices/<name>/)
    n_items: Optional[int] = None  # overrides the size's item count
    num_fewshot: Optional[int] = None  # None: the task YAML's own setting
    limit: Optional[int] = None  # lm-eval limit per task (registry tasks)
    filter: Optional[str] = None  # lm-eval filter scored in the records (tasks with several); None: the first
    divergence_texts: int = 16  # gold texts scored for KL / PPL
    # Score KL / PPL along the reference's own replies (prompt + reference generation) instead of the
    # gold texts: the long-generation slice's view of error growing with length.
    divergence_from_reference: bool = False
    # Items whose served text (prompt as evaluated + the reference's reply) is scored for KL when the model
    # is evaluated through its chat template (harness.job.divergence_texts.served_texts); None: every item.
    served_texts: Optional[int] = None
    metadata: dict[str, Any] = field(default_factory=dict)  # passed to the item generator
    # The item field holding its stratum, a cell the slice enumerates on purpose (docs/explanation/strata.md).
    # None: the field "stratum" where the items have it; otherwise (a registry task) one stratum.
    stratum_field: Optional[str] = None
    # The item field holding its cluster, the items sharing content drawn at random (docs/explanation/strata.md).
    # None: the field "cluster" where the items have it; otherwise (a registry task) every item its own cluster.
    cluster_field: Optional[str] = None


@dataclass
class EvalConfig:
    size: str = "quick"  # default item-set size of every slice
    seed: int = 1234  # item generation and lm-eval seeds
    batch_size: Optional[int] = None  # None: the model config's batch size
    divergence_max_tokens: int = 1024  # longer gold texts are truncated (long-context: window)
    # Also score each slice's gold texts (prompt + gold answer, no chat template): kl_plain_mean and the other
    # *_plain metrics, and for a base model (no chat template) its headline, as before this option existed. Off: every
    # model's headline is its served replies. Cost when on: one more forward of both models over every gold
    # text, which no evaluation has run (the default job: ~6.1k tokens per model, +9 % on its ~65k; each
    # long-context text up to divergence_max_tokens).
    divergence_plain: bool = False
    # How the reference distribution is cached: hidden (final hidden state + the reference's output
    # head: exact, hidden_size floats/token) | logprobs (exact, vocab_size floats/token) | topk
    # (top-k + tail: a lower bound of KL, ~6% low at k=256 on SmolLM2; see benchmarks/).
    reference_store: str = "hidden"
    reference_topk: int = 256  # k for reference_store=topk
    # hf: both sides through lm-eval's HFLM on the loaded model | an in-process engine of harness.engines (vllm:
    # lm-eval's vLLM backend) on the checkpoints (model.path and candidate.path; quant=external), the same engine a
    # deployment serves with
    backend: str = "hf"
    # Greedy generation with backend=hf: harness (rows leave the batch as they finish; same replies, a
    # fraction of the decode steps on a CPU: harness.evaluation.generation) | hf (HF generate, as lm-eval runs it)
    generator: str = "harness"
    # Caps every generation task's max_gen_toks (each keeps its own where that is lower); null: each task's
    # own. A smoke run's knob: replies cut short score differently, so a capped run is its own result (run key,
    # reference entry) and says so on the console. A random-weight model never stops, so its generation
    # always runs to the cap: the test suite's tiny jobs use it.
    max_gen_toks: Optional[int] = None
    # Tokens added to every generation task's max_gen_toks for the trace when model.thinking is on, on both sides
    # (eval.max_gen_toks still caps the total); a reply whose trace has not closed by then is scored wrong
    thinking_budget: int = 4096
    position_buckets: list[int] = field(default_factory=lambda: [0, 128, 512, 1024, 2048, 4096, 8192])
    # Sequential evaluation (harness.evaluation.sequential_run): the candidate answers each slice's items in rounds of
    # whole clusters (seeded random order) and a slice stops once its anytime-valid confidence sequence
    # settles the gate's decision (pass / fail at gate.alpha and the slice's margin); off by default.
    sequential: bool = False
    sequential_round_items: Optional[int] = None  # items per round; None: ~1/8 of the slice, at least 8
    # spending: the clustered score test at the rounds with O'Brien-Fleming-type alpha-spending (settles clustered
    # slices too; as trustworthy as the fixed gate, whose few-cluster guard it keeps); betting: a confidence
    # sequence assuming nothing beyond bounded scores and i.i.d. clusters (settles only slices of many clusters,
    # e.g. registry tasks whose items are their own clusters). README "Sequential evaluation".
    sequential_method: str = "spending"


@dataclass
class CompareConfig:
    n_resamples: int = 2000  # paired bootstrap resamples (>= 1000)
    ci_level: float = 0.95
    seed: int = 0
    margin: float = 0.02  # non-inferiority margin (accuracy points / 100)
    min_clusters: int = 5  # fewer clusters in a row: verdict "too few clusters" (lower: verdicts on thin evidence)
    correction: str = "holm"  # holm | bh | none, across all tests of a run


@dataclass
class TokenGateConfig:
    """Token-level limits of the deployment gate (None: not gated)."""

    kl_mean_max: Optional[float] = None  # fail a slice whose mean KL(ref || quant) in nats exceeds this
    top1_agree_min: Optional[float] = None  # fail a slice whose top-1 agreement falls below this


@dataclass
class GateConfig:
    """The ship / no-ship decision per slice (harness.decision.gate): pass, fail or inconclusive."""

    enabled: bool = False  # gate every job at its end (gate.json + gate.xml in results/<run>/)
    margin: Optional[float] = None  # non-inferiority margin in accuracy (0.02 = 2 pt); None: compare.margin
    margins: dict[str, float] = field(default_factory=dict)  # per-slice margins, e.g. {code: 0.05}
    alpha: float = 0.05  # level of the one-sided tests (after the correction)
    correction: Optional[str] = None  # holm | bh | none across the run's gated slices; None: compare.correction
    min_items: int = 30  # fewer items: inconclusive (a t-test on a handful of items is not a decision)
    min_clusters: int = 5  # fewer clusters: inconclusive (the clustered SE needs several clusters)
    # A slice of multi-item clusters passes only with this many random clusters (G - K + 1: strata are not counted,
    # docs/explanation/strata.md): with fewer, the score test's measured false-pass rate at the margin exceeds α
    # (benchmarks/bench_gate_oc.py; docs/explanation/gate-operating-characteristics.md). 0: off.
    min_clusters_pass: int = 20
    # Reference accuracy minus chance below this: inconclusive (a slice the reference mostly gets wrong
    # cannot show a loss). Chance is gate.chance[slice], else mc_chance per multiple-choice item, 0 generative.
    min_headroom: float = 0.10
    mc_chance: float = 0.25
    chance: dict[str, float] = field(default_factory=dict)
    token: TokenGateConfig = field(default_factory=TokenGateConfig)  # token limits for every slice
    token_slices: dict[str, TokenGateConfig] = field(default_factory=dict)  # per-slice token limits
    slices: list[str] = field(default_factory=list)  # gate only these slices ([]: every slice of the run)
    # A prompt log's gold-free outcomes (slices=prompts): the largest increase allowed, as a fraction, of refused,
    # loop, empty or cap_hit replies, or the largest loss of json, code or language kept; e.g. {refused: 0.02,
    # json: 0.05}. Read off the interval the report shows beside the outcome ({}: none gated).
    outcomes: dict[str, float] = field(default_factory=dict)
    # A thinking model's trace (model.thinking on): the largest increase allowed of trace_ratio (trace tokens,
    # candidate / reference - 1, e.g. 0.2 = 20 % longer), or of the cap_hit, unclosed or loop rates (fractions);
    # e.g. {trace_ratio: 0.2, cap_hit: 0.02}. Read off the interval the report shows ({}: none gated).
    thinking: dict[str, float] = field(default_factory=dict)
    # The pairwise judge (judge.endpoint): the largest candidate loss rate minus win rate allowed, read off the
    # paired interval the report shows (null: not gated)
    judge_loss_max: Optional[float] = None


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd
    experiment: str = "quant-harness"
    # None: <model>/<scheme>/<slices>; the MLflow run adds the outcome: "<scheme> · <model> · FAIL 4/5" (a name
    # set here keeps its words, the outcome after them)
    run_name: Optional[str] = None
    tags: dict[str, str] = field(default_factory=dict)
    # MLflow per-item tables items.json and flips.json (a review line, both replies, the prompt's end) for its
    # Artifact evaluation view (docs/guides/reviewing-in-mlflow.md)
    review_tables: bool = True
    table_prompt_chars: int = 1500  # characters of each prompt's end in those tables; 0: no prompt text in MLflow
    all_metrics: bool = False  # also log every per-slice number of summary.json under detail/ (default: a fixed set)


@dataclass
class PathsConfig:
    results_dir: str = "results"  # results/<run>/ holds items.parquet, summary.json, config
    cache_dir: str = "${oc.env:HARNESS_CACHE_DIR,${oc.env:HOME}/.cache/quant-harness}"


@dataclass
class RuntimeConfig:
    """How the job uses this machine; never part of a result's identity (run key)."""

    # torch intra-op CPU threads. None: the CPUs this job was given ($OMP_NUM_THREADS if set, else
    # the process's CPU affinity, capped by $SLURM_CPUS_PER_TASK). Set 1 beside other work: with
    # more threads than free cores every thread waits on the slowest (4x slower measured here).
    threads: Optional[int] = None
    # auto | true | false: on a CPU job with >= 2 threads, compute missing references in a second
    # process (half the threads) while this one quantizes and evaluates (harness.job.background_reference)
    reference_process: str = "auto"
    # seconds without progress (no forward of its model) after which that second process is reported
    # as stalled, killed and replaced by this job computing its references; longer than any one step
    reference_stall_s: float = 600.0
    # GiB of prompt KV caches held (on the CPU) for a slice answered before its reference is read, so the
    # reference's replies are teacher-forced from them later instead of each text being run again from its
    # first token (SmolLM2 fp32: 46 kB per prompt token; an 8B model in bf16: 128 kB). 0: run them again.
    held_kv_gb: float = 4.0
    # Greedy generation requests (eval.generator=harness) decoded together as one batch, their prompts prefilled
    # eval.batch_size at a time: a decode step on a CPU costs about as much for one row as for several (each step
    # reads every weight), so more rows share each step and a slice takes fewer (answers unchanged: padding and
    # batch composition change no reply, tested). null: eval.batch_size. Lower it when decode memory is short.
    decode_rows: Optional[int] = 64


@dataclass
class PerfConfig:
    """``perf.*``: serving speed measured on an engine (harness.engines.perf; ``python -m harness.parity perf=true``).
    Not part of any run's key: it changes no result, only how speed is measured."""

    # requests kept in flight at once, one measurement per level (a closed loop)
    concurrency: list[int] = field(default_factory=lambda: [1, 8])
    # generation prompts of the slice (as the model saw them, from the run's items), spread evenly over its items
    n_prompts: int = 8
    # times each prompt is sent per level; the intervals resample prompts with their repeats
    rounds: int = 2
    # output tokens per request
    max_tokens: int = 32
    # generate exactly max_tokens tokens whatever the model writes (vLLM's ignore_eos), so both sides do the same work
    ignore_eos: bool = True
    # requests sent and not timed before each server's first level
    warmup: int = 1
    # bootstrap resamples of each interval
    n_resamples: int = 2000
    # seed of the bootstrap
    seed: int = 0
    # level of every interval
    ci_level: float = 0.95
    # one request's limit in seconds
    timeout_s: float = 900.0
    # how long each server may take to come up, in seconds
    startup_s: float = 900.0


@dataclass
class PromptsConfig:
    """``prompts.*``: your own prompt log as the ``prompts`` slice (``slices=prompts prompts.path=FILE``): no gold
    answers; the reference's and the candidate's replies are compared (harness.results.prompt_outcomes). The
    slice's item set is keyed by the file's content, not only its path."""

    # a JSONL of chat messages, a JSONL/CSV/Parquet file with a text column, an OpenAI Batch API input file or a
    # datasets directory (harness.evaluation.prompt_log); null: the packaged example log
    path: Optional[str] = None
    # the text column of a file without chat messages; null: prompt, text or input, the first present
    field: Optional[str] = None
    # a seeded sample of this many prompts (stratified by the rows' stratum); null: every prompt
    sample: Optional[int] = None
    # new tokens per reply where a row sets no max_tokens of its own
    max_tokens: int = 256
    # log prompt and reply text to MLflow (items tables, artifacts); false: metrics, counts and hashes only, the
    # text stays in the local results directory
    log_text: bool = False
    # the reference side takes each row's logged reference_reply (the production reply) instead of generating one,
    # cut at the row's stop strings and token cap; rows without one are generated. KL and top-1 are then measured
    # along the production replies
    reference_replies: bool = False


@dataclass
class ReferenceConfig:
    """``reference.*``: a served reference (the staged production comparison): the deployed model answers the same
    items over its OpenAI-compatible server, beside a served candidate (``candidate.endpoint``/``candidate.serve``),
    in place of the reference computed in this process from ``model=``. Unset: the reference runs in process."""

    endpoint: Optional[str] = None  # the deployed reference's base URL, e.g. http://127.0.0.1:8001 (no credentials)
    serve: Optional[str] = None  # or a command that serves the reference, started on a free loopback port ({port})
    endpoint_model: Optional[str] = None  # the reference server's model id; None: its only model
    endpoint_api_key_env: Optional[str] = None  # NAME of the variable holding the reference server's key (never the key)
    endpoint_timeout_s: float = 600.0  # one request to the reference server; silent for longer: hung
    endpoint_batch_size: int = 8  # prompts per log-likelihood request to the reference server
    endpoint_concurrency: int = 1  # generation requests in flight at once
    endpoint_max_requests_per_s: Optional[float] = None  # requests started per second at most (the reference's limit)
    # log-probs asked per position along the reference's replies and gold texts; with both sides served, KL is taken
    # on the partition of tokens in both sides' top-k plus the rest: a lower bound of the exact KL
    endpoint_divergence_topk: int = 20
    serve_startup_s: float = 900.0  # how long reference.serve may take to answer /health


@dataclass
class JudgeConfig:
    """``judge.*``: an optional pairwise judge, any OpenAI-compatible chat endpoint, that reads the reference's and
    the candidate's replies to the same prompt blind, in both orders (harness.evaluation.judge). Off unless
    judge.endpoint or judge.serve is set."""

    endpoint: Optional[str] = None  # the judge server's base URL (no credentials in it)
    serve: Optional[str] = None  # or a command that serves the judge, started on a free loopback port ({port})
    model: Optional[str] = None  # the judge model's id; None: the server's only model
    api_key_env: Optional[str] = None  # NAME of the environment variable holding the judge's API key, never the key
    slices: list[str] = field(default_factory=lambda: ["prompts"])  # slices whose replies are judged
    max_tokens: int = 16  # the judge's reply: a verdict word, not an essay
    concurrency: int = 4  # judge requests in flight at once
    max_requests_per_s: Optional[float] = None  # the judge server's rate limit (null: none)
    timeout_s: float = 120.0  # one judge request
    serve_startup_s: float = 900.0  # how long judge.serve may take to answer /health


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    quant: QuantConfig = MISSING
    candidate: CandidateConfig = field(default_factory=CandidateConfig)
    slices: dict[str, SliceConfig] = field(default_factory=dict)
    eval: EvalConfig = field(default_factory=EvalConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    gate: GateConfig = field(default_factory=GateConfig)  # ship / no-ship decision (off unless gate.enabled)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)  # serving speed on an engine (not in any run's key)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)  # the prompts slice's log (keyed through it)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)  # a served reference (staged comparison)
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # an optional pairwise judge of the two sides' replies
    force: bool = False  # recompute even when a finished result for this config exists


def register_configs() -> None:
    """Register the schemas so that conf/ files are validated against them, and the search path of your own
    config directories and of ``model=hf:<id>`` (harness.infra.presets) with Hydra."""
    from harness.infra import presets

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    presets.register_with_hydra()


REPO_DIR = __import__("pathlib").Path(__file__).resolve().parents[1]
CONF_DIR = REPO_DIR / "conf"
SLICES_DIR = REPO_DIR / "slices"


# quant.gptq.*, quant.awq.* and quant.smoothquant.*: the built-in methods' settings sections before every
# method's settings moved to quant.settings.* (a key, an override or a composition error naming one)
_MOVED_SETTINGS = re.compile(r"\bquant\.(?:gptq|awq|smoothquant)\b(?:\.(\w+))?")


def moved_settings_problem(text: str) -> str | None:
    """The one-line fix when ``text`` names a key of the built-in methods' former settings sections, else None."""
    match = _MOVED_SETTINGS.search(text)
    if match is None:
        return None
    key = match.group(1)
    new = f"quant.settings.{key}" if key else "quant.settings.<name>"
    return (f"{match.group(0)} moved: every method's settings are quant.settings.* (a scheme YAML's settings: "
            f"block); use {new}")


def compose(overrides: list[str] | None = None, config_name: str = "config"):
    """Compose the run config exactly as ``python -m harness <overrides>`` would (no job run).

    For notebooks, tests and the auxiliary commands: the same defaults, schemas and errors; a key of the
    built-in methods' former settings sections is refused in one line naming its new key.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from harness.errors import UsageError
    from harness.infra import presets

    register_configs()
    overrides = presets.expand_model_path(list(overrides or []))
    presets.activate(presets.requested(overrides))  # your config directories, before Hydra builds its search path
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:
            problem = moved_settings_problem(str(error))
            if problem is None:
                raise
            raise UsageError(problem) from error
    name_what_ran(cfg, overrides)
    return cfg


def scheme_name(quant: Any, overrides: list[str]) -> str | None:
    """The name of a scheme whose fields ``overrides`` change: ``<preset>+<field>=<value>...``, fields sorted; None
    when none is changed or when ``quant.name`` is given (a scheme named by its user keeps that name).

    ``quant`` is the composed scheme (its values are what the name shows, e.g. ``int8+weights.format=toy_int3``);
    a sub-group choice (``+quant/kv_cache=fp8_dynamic``) counts as a field. So two runs whose schemes differ in a
    field never share a name, and a results directory, report, MLflow run and comparison say what ran.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    changed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if key.startswith("quant/"):  # a sub-group of the scheme, e.g. quant/kv_cache
            field_name, shown = key[len("quant/"):], override.value()
        elif key.startswith("quant."):
            field_name = key[len("quant."):]
            if field_name == "name":
                return None
            shown = None if override.is_delete() else OmegaConf.select(quant, field_name, default=None)
        else:
            continue
        changed[field_name] = _compact(shown)
    if not changed:
        return None
    return "+".join([str(quant.name), *(f"{k}={v}" for k, v in sorted(changed.items()))])


def _compact(value: Any) -> str:
    """A value as a name shows it: null, 3, toy_int3, [a,b], {bits:3}."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_compact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_compact(v) for v in value) + "]"
    return str(value)


def name_what_ran(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Give a composed config the names of what runs: quant.name of an overridden scheme (:func:`scheme_name`).

    Called once per composition, by :func:`compose` and by ``python -m harness`` on Hydra's own composition, so
    every run name, results directory, report, MLflow run and summary reads the one ``quant.name``.
    """
    quant = cfg.get("quant") if OmegaConf.is_dict(cfg) else None
    if quant is None or OmegaConf.is_missing(quant, "name"):
        return cfg
    name = scheme_name(quant, overrides)
    if name is not None:
        cfg.quant.name = name
    return cfg


def load_model_config(name: str) -> ModelConfig:
    """The ModelConfig of conf/model/<name>.yaml, validated against the schema."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.exists():
        options = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise ValueError(f"unknown model config {name!r}; available: {options}")
    raw = OmegaConf.load(path)
    raw.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), raw)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def to_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The typed run config of a composed DictConfig (a RunConfig is returned as is)."""
    if isinstance(cfg, RunConfig):
        return cfg
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def config_dict(cfg: RunConfig) -> dict:
    """The run config as plain, resolved data (what config.json holds)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
