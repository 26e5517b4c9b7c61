#!/usr/bin/env bash
# Run the whole test suite in .venv. pytest exits 5 when it collected no test: that is a failure
# here, loudly, never a green run.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -p no:cacheprovider -q "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "run-tests: FAILED: pytest collected no tests (exit 5)" >&2
  exit 1
fi
exit "$status"
