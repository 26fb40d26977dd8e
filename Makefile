# The two commands of the README. Each sets up .venv first (idempotent; see scripts/setup.sh).
PY := .venv/bin/python
ARGS ?=

.PHONY: setup run test test-fast
setup:
	@bash scripts/setup.sh

# The default job: packaged SmolLM2-135M, int4_g128, quick offline slices, ./mlflow.db.
run: setup
	$(PY) -m harness $(ARGS)

# One pytest worker per CPU; a test file stays on one worker (its module fixtures are built once);
# files are handed out in collection order, the longest first (tests/conftest.py: LONGEST_FIRST).
# One worker more than the CPUs was slower (18 min against 16: the CPUs were already busy).
XDIST := -n auto --dist loadfile --no-loadscope-reorder

# The whole test suite (fast tier + slow tier).
test: setup
	$(PY) -m pytest $(XDIST) $(ARGS)

# Only the fast tier: unit tests, property tests and one tiny_random job end to end
# (config -> quantize -> evaluate -> statistics -> gate -> MLflow); no test marked slow.
test-fast: setup
	$(PY) -m pytest $(XDIST) -m "not slow" $(ARGS)
