"""Architecture adapters: the per-family facts calibrated methods need, and how to run one block.

GPTQ and AWQ are written once against :class:`Adapter`; a model family contributes only
where its decoder blocks live, which norm or linear feeds which linears (the "groups"), how
its norms scale (Llama ``x·w``, Gemma ``x·(1 + w)``), and which linears AWQ must not clip.
Adding a family is one ``register_adapter(Adapter(...))`` call.

Running blocks one at a time (so that a model larger than the accelerator can be
quantized) needs each block's inputs. :func:`capture_block_inputs` runs the model's
embedding stage once per calibration batch with every block replaced by a recorder (the
"Catcher" idea): it keeps the first block's hidden states and every block's other
arguments (attention mask, rotary position embeddings, which differ between Gemma's
sliding and global layers). :func:`run_block` then replays a block on new hidden states,
and :func:`staged_forward` runs it on every batch with pauses before chosen modules, so
that GPTQ can quantize a block's linears in order during a single forward pass.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from harness.infra.devices import compute_device, set_thread_device
from harness.quant.experts import UnfusedExperts

log = logging.getLogger(__name__)


class StopForward(Exception):
    """Raised by a hook to end a forward pass early once the wanted inputs are recorded."""


@dataclass(frozen=True)
class LinearGroup:
    """Linears that read the output of one module (all of its consumers), with names inside a block.

    ``prev`` is the norm or linear whose output is the group's input: AWQ folds ``1/s`` into it
    and multiplies the ``linears``' input columns by ``s``. ``inspect`` is the sub-module whose
    output AWQ's scale search compares (llm-awq's ``module2inspect``); its input must be the
    group's input. Groups are listed in dependency order, which is also GPTQ's order.
    """

    prev: str
    linears: tuple[str, ...]
    inspect: str


@dataclass(frozen=True)
class Adapter:
    """Where a family keeps its decoder blocks and how their modules connect."""

    name: str
    model_types: tuple[str, ...]  # config.model_type values this adapter serves
    groups: tuple[LinearGroup, ...]
    norm_offset: float = 0.0  # the norm multiplies by (norm_offset + weight): 0 Llama, 1 Gemma
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")  # llm-awq never clips q/k
    decoder_attr: str = "model"  # CausalLM attribute holding the decoder (embeddings, blocks, final norm)
    layers_attr: str = "layers"  # decoder attribute holding the ModuleList of blocks

    def decoder(self, model: nn.Module) -> nn.Module:
        return getattr(model, self.decoder_attr)

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return getattr(self.decoder(model), self.layers_attr)

    def block_name(self, index: int) -> str:
        """Module name of block ``index`` in ``model.named_modules()``."""
        return f"{self.decoder_attr}.{self.layers_attr}.{index}"

    def linear_names(self) -> list[str]:
        return [name for group in self.groups for name in group.linears]

    def foldable_groups(self, block: nn.Module) -> list[LinearGroup]:
        """Groups whose ``prev`` can absorb a per-channel scale exactly.

        A norm always can. A linear can when its output channels map one to one onto the
        group's input channels: v→o only without grouped-query attention (v's output is
        kv_heads·head_dim, o's input heads·head_dim), up→down always.
        """
        out = []
        for group in self.groups:
            if not has_modules(block, group):  # a MoE family's dense blocks lack the expert groups, and back
                continue
            prev = block.get_submodule(group.prev)
            if isinstance(prev, nn.Linear):
                sizes = {block.get_submodule(n).in_features for n in group.linears}
                if sizes != {prev.out_features}:
                    continue
            out.append(group)
        return out


_ADAPTERS: dict[str, Adapter] = {}


def has_modules(block: nn.Module, group: LinearGroup) -> bool:
    """Whether ``block`` has every module ``group`` names (prev, linears, inspected)."""
    for name in (group.prev, group.inspect, *group.linears):
        try:
            block.get_submodule(name)
        except AttributeError:
            return False
    return True


def register_adapter(adapter: Adapter) -> Adapter:
    for model_type in adapter.model_types:
        _ADAPTERS[model_type] = adapter
    return adapter


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for ``model.config.model_type``; the error lists the known families.

    A mixture-of-experts model whose experts are unfused (:mod:`harness.quant.experts`) gets an adapter built
    for its number of experts.
    """
    moe = moe_adapter(model)
    if moe is not None:
        return moe
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"no calibration adapter for model_type={model_type!r} ({type(model).__name__}); known: "
            f"{sorted(_ADAPTERS)}. Fix: register one with harness.quant.architectures.register_adapter(Adapter(...)) "
            "naming its norms and linears, or use a method without calibration (quant.method=rtn)")
    return _ADAPTERS[model_type]


_ATTN = "self_attn"
LLAMA = register_adapter(Adapter(
    name="llama",
    model_types=("llama", "mistral"),  # SmolLM2 and the tiny test model are LlamaForCausalLM
    groups=(
        LinearGroup("input_layernorm", (f"{_ATTN}.q_proj", f"{_ATTN}.k_proj", f"{_ATTN}.v_proj"), _ATTN),
        LinearGroup(f"{_ATTN}.v_proj", (f"{_ATTN}.o_proj",), f"{_ATTN}.o_proj"),
        LinearGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        LinearGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
))

# Gemma 3: post_attention_layernorm normalises the attention *output*; the MLP is fed by
# pre_feedforward_layernorm. RMSNorm weights are stored as w with the scale (1 + w).
GEMMA3 = register_adapter(Adapter(
    name="gemma3",
    model_types=("gemma3_text",),
    norm_offset=1.0,
    groups=(
        LinearGroup("input_layernorm", (f"{_ATTN}.q_proj", f"{_ATTN}.k_proj", f"{_ATTN}.v_proj"), _ATTN),
        LinearGroup(f"{_ATTN}.v_proj", (f"{_ATTN}.o_proj",), f"{_ATTN}.o_proj"),
        LinearGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        LinearGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
))


# Families whose blocks are llama-style attention + a sparse MoE block ``mlp`` (router ``mlp.gate``, experts
# ``mlp.experts``) fed by ``post_attention_layernorm``; dense blocks (Qwen3-MoE's mlp_only_layers) are llama MLPs.
# Qwen2-MoE (its shared expert runs before the router), gpt-oss (its up projection is clamped: AWQ cannot fold
# into it) and DeepSeek-V3 (MLA attention) have no calibration adapter yet; RTN-family schemes cover them.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


def moe_adapter(model: nn.Module) -> Any:
    """The calibration adapter of an unfused MoE model of :data:`MOE_FAMILIES` (None for other models).

    The norm feeding the MoE block has one group holding all its consumers, the router first (AWQ records
    the group's input statistics on its first member, which sees every token, and folds ``1/s`` into the
    norm and ``s`` into every consumer, the router included; SmoothQuant likewise); then one group
    ``experts.<e>.up_proj → experts.<e>.down_proj`` per expert, whose statistics are the routed tokens'.
    GPTQ splits the shared group per expert (:func:`expert_stages`).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    experts = [m for m in model.modules() if isinstance(m, UnfusedExperts)]
    if model_type not in MOE_FAMILIES or not experts:
        return None
    count = max(len(m) for m in experts)
    attn = "self_attn"
    gate_up = tuple(f"mlp.experts.{e}.{p}" for e in range(count) for p in ("gate_proj", "up_proj"))
    groups = [
        LinearGroup("input_layernorm", (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"), attn),
        LinearGroup(f"{attn}.v_proj", (f"{attn}.o_proj",), f"{attn}.o_proj"),
        LinearGroup("post_attention_layernorm", ("mlp.gate",) + gate_up, "mlp"),
        *[LinearGroup(f"mlp.experts.{e}.up_proj", (f"mlp.experts.{e}.down_proj",), f"mlp.experts.{e}.down_proj")
          for e in range(count)],
        LinearGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),  # dense blocks
        LinearGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ]
    return Adapter(name=f"{model_type} (unfused experts)", model_types=(model_type,), groups=tuple(groups))


# ------------------------------------------------------------------------------- running blocks
Extra = tuple[tuple[Any, ...], dict[str, Any]]  # a block's positional arguments after hidden states, and kwargs


@dataclass
class BlockInputs:
    """What the blocks receive: hidden states of the current block per batch, others per block."""

    hidden: list[Tensor]  # [batch][B, T, hidden] input of the block being processed
    extras: list[list[Extra]]  # [block][batch] the other arguments, as the model passed them


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    value = args[0] if args else kwargs["hidden_states"]
    return value[0] if isinstance(value, (tuple, list)) else value


@torch.no_grad()
def capture_block_inputs(model: nn.Module, adapter: Adapter, batches: list[Tensor],
                         device: torch.device) -> BlockInputs:
    """Run the embedding stage on ``device`` with every block replaced by a recorder.

    The decoder's own modules outside the blocks (embeddings, rotary embedding, final norm)
    visit ``device`` for the duration; blocks stay where they are and are never executed.
    """
    decoder, blocks = adapter.decoder(model), adapter.blocks(model)
    hidden: list[Tensor] = []
    extras: list[list[Extra]] = [[] for _ in blocks]
    last = len(blocks) - 1

    def recorder(index: int):
        def forward(*args: Any, **kwargs: Any) -> tuple[Tensor]:
            if index == 0:
                hidden.append(_first_tensor(args, kwargs))
            rest = args[1:] if args else ()
            extras[index].append((rest, {k: v for k, v in kwargs.items() if k != "hidden_states"}))
            if index == last:
                raise StopForward
            # A one-tuple suits both conventions: transformers 5 passes it on to the next recorder,
            # older versions take element 0; either way no real block runs.
            return (_first_tensor(args, kwargs),)
        return forward

    others = [child for child in decoder.children() if child is not blocks]
    homes = [_device_of(child) for child in others]
    for index, block in enumerate(blocks):
        block.forward = recorder(index)  # instance attribute shadows the class method
    try:
        for child in others:
            child.to(device)
        for batch in batches:
            try:
                decoder(input_ids=batch.to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        for block in blocks:
            del block.forward
        for child, home in zip(others, homes):
            if home is not None:
                child.to(home)
    return BlockInputs(hidden=hidden, extras=extras)


def run_block(block: nn.Module, hidden: Tensor, extra: Extra) -> Tensor:
    """Run one decoder block on ``hidden`` with the arguments the model gave it."""
    args, kwargs = extra
    out = block(hidden, *args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


class _Abort(Exception):
    """Unwinds a paused batch when the staged forward is abandoned."""


class _BatchThread(threading.Thread):
    """Runs one batch through a block; hooks pause it by handing control back to the caller."""

    def __init__(self, block: nn.Module, hidden: Tensor, extra: Extra, device: torch.device):
        super().__init__(daemon=True)
        self.block, self.hidden, self.extra, self.device = block, hidden, extra, device
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        try:
            if self.inbox.get() == "abort":
                return
            set_thread_device(self.device)  # the current CUDA device is per thread; always indexed
            with torch.no_grad():  # grad mode is per thread
                self.outbox.put(("done", run_block(self.block, self.hidden, self.extra)))
        except _Abort:
            self.outbox.put(("aborted", None))
        except BaseException as exc:  # handed to the caller, which re-raises it
            self.outbox.put(("error", exc))

    def pause(self, stage: int) -> None:
        self.outbox.put(("paused", stage))
        if self.inbox.get() == "abort":
            raise _Abort

    def advance(self) -> tuple[str, Any]:
        self.inbox.put("go")
        kind, value = self.outbox.get()
        if kind == "error":
            raise value
        return kind, value


@torch.no_grad()
def staged_forward(block: nn.Module, hidden: list[Tensor], extras: list[Extra], stops: list[nn.Module],
                   on_input: Callable[[int, Tensor], None], on_stage: Callable[[int], None],
                   device: torch.device) -> list[Tensor]:
    """Run ``block`` once on every batch, pausing all batches at each module of ``stops`` in turn.

    Each batch runs in its own thread, strictly one at a time: it runs until it is about to call
    ``stops[k]``, passes that module's input to ``on_input(k, x)`` and waits. Once every batch
    waits there, ``on_stage(k)`` runs (GPTQ quantizes stage k's linears) and the batches resume
    with the changed weights. So every batch's forward is computed exactly once, however many
    stages there are, at the cost of holding every batch's intermediate activations at a stop
    (SmolLM2, 128 × 512 tokens on CPU: ~2.3 GB, plus ~1.6 GB that glibc's per-thread malloc
    arenas retain unless ``MALLOC_ARENA_MAX=2``; on a GPU the caching allocator is shared).
    Returns the block outputs per batch.
    """
    handles = []
    for stage, module in enumerate(stops):
        def hook(_module: nn.Module, args: tuple, stage: int = stage) -> None:
            thread = threading.current_thread()
            if not isinstance(thread, _BatchThread):  # someone else runs the block: not ours to stage
                return
            on_input(stage, args[0])
            thread.pause(stage)
        handles.append(module.register_forward_pre_hook(hook))
    threads = [_BatchThread(block, h, e, compute_device(device)) for h, e in zip(hidden, extras)]
    for thread in threads:
        thread.start()
    try:
        for stage in range(len(stops)):
            for number, thread in enumerate(threads):
                kind, value = thread.advance()
                if (kind, value) != ("paused", stage):
                    raise RuntimeError(f"batch {number} did not reach stage {stage} ({stops[stage]}) next "
                                       f"(got {kind} {value if kind == 'paused' else ''}); the adapter's group order "
                                       "does not match the block's order of execution")
            on_stage(stage)
        outputs = []
        for number, thread in enumerate(threads):
            kind, value = thread.advance()
            if kind != "done":
                raise RuntimeError(f"batch {number} paused again at stage {value} after the last stage")
            outputs.append(value)
        return outputs
    finally:
        for handle in handles:
            handle.remove()
        for thread in threads:
            if thread.is_alive():
                thread.inbox.put("abort")
                thread.join()


def _device_of(module: nn.Module) -> torch.device | None:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return None


@contextlib.contextmanager
def block_on_device(block: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """Move one block to the compute device and back to where it lived (no-op when they agree).

    A block that accelerate placed (``model.device=auto``) stays where it is and computes there:
    its hook moves its inputs to its own device, so moving its weights would split the two.
    """
    if getattr(block, "_hf_hook", None) is not None:
        yield block
        return
    home = _device_of(block)
    block.to(device)
    try:
        yield block
    finally:
        if home is not None and home != torch.device(device):
            block.to(home)


@torch.no_grad()
def round_outside_blocks(model: nn.Module, adapter: Adapter, scheme: Any, targets: dict[str, nn.Linear],
                         report: Any) -> list[str]:
    """Round to nearest the target linears a calibrated method cannot reach; returns their weight names.

    Those outside the decoder blocks (an lm_head removed from ``keep``) get a warning and a
    report note; a target inside a block that the adapter's groups do not name is an error,
    because the method's order of work would silently skip it.
    """
    from harness.quant.format_table import SchemeError, fake_quantize
    from harness.quant.targets import bits_for

    blocks_prefix = adapter.block_name(0).rsplit(".", 1)[0] + "."
    known = {f"{adapter.block_name(i)}.{n}" for i in range(len(adapter.blocks(model))) for n in adapter.linear_names()}
    unknown = [n for n in targets if n.startswith(blocks_prefix) and n not in known]
    if unknown:
        raise SchemeError(f"{scheme.method}: the {adapter.name} adapter does not know the linears {unknown[:3]}; add "
                          "them to its groups or exclude them with quant.keep")
    changed = []
    for name, module in targets.items():
        if name.startswith(blocks_prefix):
            continue
        log.warning("%s: %s lies outside the decoder blocks; rounding it to nearest instead", scheme.method, name)
        report.notes.append(f"{scheme.method}: {name} rounded to nearest (outside the decoder blocks)")
        quantized = fake_quantize(module.weight.data, scheme.weights)
        report.add_layer(name, module.weight.data, quantized, bits_for(scheme, module))
        module.weight.data.copy_(quantized)
        changed.append(f"{name}.weight")
    return changed


@contextlib.contextmanager
def small_ops_threads(device: torch.device | str) -> Iterator[None]:
    """One intra-op thread on CPU for loops of small tensor ops (GPTQ's column loop, clip search).

    Each op is too small to share between threads, and with more threads than free cores
    (other jobs on the machine) every op pays a thread-synchronisation stall: the GPTQ solve of
    one 1536×576 weight takes ~0.45 s on one thread and ~15 s on two busy cores. No-op elsewhere.
    """
    if torch.device(device).type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_batches(tokens: Tensor, batch_size: int) -> list[Tensor]:
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return [tokens[i:i + batch_size] for i in range(0, len(tokens), batch_size)]


class BlockProgress:
    """Logs one line per finished block with the elapsed time and an ETA from the mean rate."""

    def __init__(self, method: str, total: int):
        self.method, self.total, self.start = method, total, time.perf_counter()
        self.block_seconds: list[float] = []
        self._last = self.start

    def done(self, index: int) -> None:
        now = time.perf_counter()
        self.block_seconds.append(now - self._last)
        self._last = now
        elapsed = now - self.start
        remaining = elapsed / (index + 1) * (self.total - index - 1)
        log.info("%s: block %d/%d done in %.1fs (elapsed %s, ETA %s)", self.method, index + 1, self.total,
                 self.block_seconds[-1], _clock(elapsed), _clock(remaining))


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s"
