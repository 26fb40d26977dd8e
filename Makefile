# The two commands of the README. Each sets up .venv first (idempotent; see scripts/setup.sh).
PY := .venv/bin/python
ARGS ?=

.PHONY: setup run test test-fast
setup:
	@bash scripts/setup.sh

# The default job: packaged SmolLM2-135M, int4_g128, quick offline slices, ./mlflow.db.
run: setup
	$(PY) -m harness $(ARGS)

# The whole test suite (fast tier + real-model tier).
test: setup
	$(PY) -m pytest $(ARGS)

# Only the fast tier (tiny random model; no SmolLM2 / Gemma).
test-fast: setup
	$(PY) -m pytest -m "not slow" $(ARGS)
