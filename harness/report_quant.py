"""``python -m harness.report_quant``: what a scheme does to each layer's weights, with no evaluation (:mod:`harness.decision.quant_report`)."""
from harness.decision.quant_report import main

if __name__ == "__main__":
    raise SystemExit(main())
