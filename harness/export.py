"""``python -m harness.export``: a scheme written as a compressed-tensors checkpoint, checked by a round trip (:mod:`harness.checkpoint.export`)."""
from harness.checkpoint.export import main

if __name__ == "__main__":
    raise SystemExit(main())
