"""``python -m harness.export``: a scheme written as a compressed-tensors checkpoint, checked by a round trip
(:mod:`harness.checkpoint.export`); with ``format=gguf``, the reference written as a GGUF for llama.cpp and
quantized by llama.cpp's own quantizer (:mod:`harness.checkpoint.export_gguf`)."""
from __future__ import annotations

import sys
from typing import Any


def __getattr__(name: str) -> Any:
    """``TOOL``: the compressed-tensors export's (its ``--help``); ``format=gguf`` has its own
    (:data:`harness.checkpoint.export_gguf.TOOL`)."""
    if name == "TOOL":
        from harness.checkpoint.export import TOOL
        return TOOL
    raise AttributeError(name)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "format=gguf" in args:
        from harness.checkpoint.export_gguf import main as gguf_main

        return gguf_main(args)
    from harness.checkpoint.export import main as ct_main

    return ct_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
