"""``python -m harness.report_quant``: what a scheme does to each layer's weights, with no evaluation (:mod:`harness.sizing.report_quant`)."""
from harness.sizing.report_quant import main

if __name__ == "__main__":
    raise SystemExit(main())
