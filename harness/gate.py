"""``python -m harness.gate``: the ship / no-ship gate over finished runs (:mod:`harness.decision.gate`)."""
from harness.decision.gate import main

if __name__ == "__main__":
    raise SystemExit(main())
