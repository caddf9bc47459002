# lowband: `make demo` trains the demo model on 2 CPU ranks; `make test` runs the whole test suite.
# Both create .venv on first use (torch==2.13.0 CPU build first, then the project).
.PHONY: setup demo test lint
setup:
	@bash scripts/setup.sh
demo: setup
	.venv/bin/python -m lowband.train --config configs/demo.toml
# TEST_WORKERS: pytest-xdist workers (work stealing). 2 by default: on this 2-core machine the suite took
# 28.3 min on 2 workers against 35.4 min in one process (session 27, same clone, one after the other); the
# load is that of two suites side by side, which every session checks before it stops. 0: one process.
TEST_WORKERS ?= 2
test: setup
	.venv/bin/python -m pytest tests $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)
lint: setup
	.venv/bin/ruff check .
