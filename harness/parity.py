"""``python -m harness.parity``: a scheme's simulation against its served export (:mod:`harness.job.parity_runs`)."""
from harness.job.parity_runs import main

if __name__ == "__main__":
    raise SystemExit(main())
