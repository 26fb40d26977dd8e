"""``python -m harness.ledger``: the memory and decode-speed ledger of schemes on GPUs (:mod:`harness.sizing.ledger`)."""
from harness.sizing.ledger import main

if __name__ == "__main__":
    raise SystemExit(main())
