"""``python -m harness.sensitivity``: per-layer sensitivity of a model to a scheme (:mod:`harness.planning.sensitivity`)."""
from harness.planning.sensitivity import main

if __name__ == "__main__":
    raise SystemExit(main())
