"""``python -m harness.sync``: finished results logged to MLflow after the fact (:mod:`harness.results.sync`)."""
from harness.results.sync import main

if __name__ == "__main__":
    raise SystemExit(main())
