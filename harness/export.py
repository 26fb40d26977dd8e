"""``python -m harness.export``: a scheme written as a compressed-tensors checkpoint, checked by a round trip
(:mod:`harness.checkpoint.export`); with ``format=gguf``, the reference written as a GGUF for llama.cpp and
quantized by llama.cpp's own quantizer (:mod:`harness.checkpoint.export_gguf`)."""
from harness.checkpoint.export import main

if __name__ == "__main__":
    raise SystemExit(main())
