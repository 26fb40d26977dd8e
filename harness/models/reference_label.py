"""What the reference is, in one phrase for headers and descriptions.

A run's reference is the model as the harness loaded it, not necessarily an unquantized model: the
default (``model=smollm2_135m``) is the packaged Q4_1 GGUF dequantized to float32, so its weights
carry Q4_1's rounding and a candidate is compared with that. A hub model is the checkpoint in
``model.dtype`` (bf16 for most presets: the dtype the checkpoint ships in).
"""
from __future__ import annotations

from typing import Any

__all__ = ["describe_reference"]


def describe_reference(model: Any) -> str:
    """``"the reference (SmolLM2-135M-Instruct.Q4_1.gguf dequantized to float32)"``: from a model config
    (:class:`harness.config.ModelConfig` or its dict)."""
    get = model.get if isinstance(model, dict) else (lambda key, default=None: getattr(model, key, default))
    source, dtype = get("source"), get("dtype") or "its stored dtype"
    if source == "gguf_package":
        what = f"{get('gguf_file')} dequantized to {dtype}"
    elif source == "tiny_random":
        what = f"random weights in {dtype}"
    else:
        what = f"{get('path') or get('name')} in {dtype}"
    return f"the reference ({what})"
