# lowband: `make demo` trains the demo model on 2 CPU ranks; `make test` runs the whole test suite.
# Both create .venv on first use (torch==2.13.0 CPU build first, then the project).
.PHONY: setup demo test lint
setup:
	@bash scripts/setup.sh
demo: setup
	.venv/bin/python -m lowband.train --config configs/demo.toml
# TEST_WORKERS=2: two pytest workers (pytest-xdist, work stealing), opt-in until a CI run on a quiet machine
# has checked it; the default 0 runs the suite in one process
TEST_WORKERS ?= 0
test: setup
	.venv/bin/python -m pytest tests $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)
lint: setup
	.venv/bin/ruff check .
