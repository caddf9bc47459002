# lowband: `make demo` trains the demo model on 2 CPU ranks; `make test` runs the whole test suite.
# Both create .venv on first use (torch==2.13.0 CPU build first, then the project).
.PHONY: setup demo test lint
setup:
	@bash scripts/setup.sh
demo: setup
	.venv/bin/python -m lowband.train --config configs/demo.toml
test: setup
	.venv/bin/python -m pytest tests
lint: setup
	.venv/bin/ruff check .
