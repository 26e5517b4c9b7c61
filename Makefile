# The two README commands. Both set everything up first (idempotent), then do their job.
.PHONY: setup demo test lint

setup:
	scripts/setup.sh

demo: setup
	.venv/bin/specrag demo

lint: setup
	.venv/bin/ruff check specrag tests bench
	.venv/bin/ruff format --check specrag tests bench
	.venv/bin/mypy

test: setup lint
	scripts/run-tests.sh
