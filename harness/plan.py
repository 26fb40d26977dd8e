"""``python -m harness.plan``: a sweep's time, memory and disk, before it runs (:mod:`harness.planning.plan`)."""
from harness.planning.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
