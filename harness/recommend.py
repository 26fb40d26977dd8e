"""``python -m harness.recommend``: the scheme that fits a memory budget, from per-layer sensitivity (:mod:`harness.planning.recommend`)."""
from harness.planning.recommend import main

if __name__ == "__main__":
    raise SystemExit(main())
