"""Device names: one spelling per device, checked before a model is loaded.

``model.device`` accepts ``cpu``, ``cuda``, ``cuda:N`` and ``auto``. An unindexed ``cuda``
means "the current CUDA device", which is device 0 in a fresh process (the launcher's
``CUDA_VISIBLE_DEVICES`` decides which physical GPU that is), so it is rewritten to ``cuda:0``
once, when the config is built (:func:`normalize`): from then on every consumer sees an index,
and calls such as ``torch.cuda.set_device`` — which refuses an unindexed ``torch.device`` —
cannot meet one. ``auto`` means "let accelerate spread the model over the visible GPUs (and CPU
/ disk offload past ``model.max_memory``)"; the device a stage computes on is then the device
the relevant module lives on (:func:`module_device`), never the string ``auto``.

Whether a device exists and can run a dtype is a property of the machine, not of the config,
so :func:`check` runs at load time (before any weight is read), not at config time: a sweep can
be planned on a laptop for a GPU cluster.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from harness.errors import UserError

AUTO = "auto"
_CUDA = re.compile(r"^cuda(?::(\d+))?$")


class DeviceError(UserError, ValueError):
    """A device name that is malformed, absent on this machine, or cannot run the dtype."""


def normalize(spec: str) -> str:
    """The one spelling of a device: ``cpu``, ``cuda:N`` or ``auto`` (``cuda`` → ``cuda:0``).

    Pure string work (no CUDA call), so it is safe at config time on any machine. Names it does
    not know are returned unchanged for :func:`check` to reject with a message.
    """
    text = str(spec).strip()
    lowered = text.lower()
    if lowered in ("cpu", AUTO):
        return lowered
    match = _CUDA.match(lowered)
    if match:
        return f"cuda:{int(match.group(1) or 0)}"
    return text


def compute_device(spec: str | torch.device) -> torch.device:
    """``torch.device`` of a normalised, concrete spec (never unindexed CUDA, never ``auto``)."""
    if isinstance(spec, torch.device):
        if spec.type == "cuda" and spec.index is None:
            return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        return spec
    name = normalize(spec)
    if name == AUTO:
        raise DeviceError("model.device=auto has no single compute device; ask the model where a module lives "
                          "(harness.infra.devices.module_device) instead")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise DeviceError(f"device {spec!r} is not a torch device name ({exc}); use cpu, cuda, cuda:N or auto") from None


def module_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: its first parameter's (or buffer's) device, or the CPU.

    Under accelerate's offload hooks an offloaded module's parameters sit on the ``meta``
    device and are brought to the hook's execution device for each forward; that device is
    the one returned then.
    """
    hook = getattr(module, "_hf_hook", None)
    execution = getattr(hook, "execution_device", None)
    if execution is not None:
        return torch.device(execution) if not isinstance(execution, int) else torch.device("cuda", execution)
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def set_thread_device(device: torch.device | str) -> None:
    """Make ``device`` the current CUDA device of the calling thread (no-op off CUDA).

    The current device is per thread; a worker thread that launches kernels for a model on
    ``cuda:1`` must select it, or its temporaries land on ``cuda:0``.
    """
    device = compute_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _dtype_error(device: str, dtype: torch.dtype) -> str | None:
    if device.startswith("cuda") and dtype == torch.bfloat16:
        index = torch.device(device).index or 0
        major, _minor = torch.cuda.get_device_capability(index)
        if major < 8:
            name = torch.cuda.get_device_name(index)
            return (f"model.dtype=bfloat16 needs a GPU of compute capability 8.0 or later (Ampere, Hopper); "
                    f"{device} is {name} (sm_{major}{_minor}). Use model.dtype=float16 or float32")
    return None


def check(spec: str, dtype: torch.dtype, *, option: str = "model.device") -> str:
    """Validate a device name against this machine and return its normalised form.

    Raises :class:`DeviceError` naming the bad value and the fix when the name is malformed, the
    device (or CUDA itself) is absent, or the device cannot run ``dtype``.
    """
    name = normalize(spec)
    if name in ("cpu", AUTO):
        return name
    if not _CUDA.match(name):
        raise DeviceError(f"{option}={spec!r} is not a device this harness uses; use cpu, cuda, cuda:N or auto")
    if not torch.cuda.is_available():
        raise DeviceError(f"{option}={spec!r} but torch sees no CUDA device (torch {torch.__version__}, "
                          f"CUDA build: {torch.version.cuda or 'none'}). On a CPU machine pass {option}=cpu "
                          "model.dtype=float32")
    index = torch.device(name).index or 0
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"{option}={spec!r} but this process sees {count} CUDA device(s) (cuda:0..cuda:{count - 1}; "
                          "CUDA_VISIBLE_DEVICES renumbers them); pick one of those or use auto")
    problem = _dtype_error(name, dtype)
    if problem:
        raise DeviceError(f"{option}={spec!r}: {problem}")
    return name


def parse_max_memory(max_memory: dict | None) -> dict[int | str, str] | None:
    """accelerate's ``max_memory`` from the config's mapping.

    Keys are strings in the config (Hydra's override grammar has no integer or ``cuda:N`` keys):
    a GPU index as ``"0"``, ``gpu0`` or ``cuda0``, and ``cpu`` / ``disk``. Values are sizes
    accelerate understands (``70GiB``, ``500MB``, a byte count).
    """
    if not max_memory:
        return None
    out: dict[int | str, str] = {}
    for key, value in dict(max_memory).items():
        text = str(key).strip().lower()
        match = re.match(r"^(?:gpu|cuda:?)?(\d+)$", text)
        if text in ("cpu", "disk"):
            out[text] = str(value)
        elif match:
            out[int(match.group(1))] = str(value)
        else:
            raise DeviceError(f"model.max_memory key {key!r}: expected a GPU index (0, gpu0, cuda0), cpu or disk")
    return out


def calibration_device(model: nn.Module, device: str) -> torch.device:
    """Where calibration batches start: the embeddings' device for ``auto`` (each block then computes
    where accelerate placed it), else the configured device, indexed."""
    if device == AUTO:
        return module_device(model.get_input_embeddings())
    return compute_device(device)
