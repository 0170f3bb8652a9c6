#!/usr/bin/env bash
# Runs scripts/anthropic-client.py against a running `encore serve` at URL,
# with the official `anthropic` client from PyPI installed into a virtual
# environment (kept in target/anthropic-venv, made on first use).
#
#   scripts/anthropic-client.sh http://127.0.0.1:8080
set -euo pipefail
cd "$(dirname "$0")/.."
url=${1:?usage: scripts/anthropic-client.sh URL}
venv=${ANTHROPIC_VENV:-target/anthropic-venv}
if [[ ! -x $venv/bin/python ]]; then
    python3 -m venv "$venv" || {
        echo "python3 -m venv failed: install python3-venv (Debian)" >&2
        exit 1
    }
fi
if ! "$venv/bin/python" -c 'import anthropic' 2>/dev/null; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check 'anthropic>=0.40,<3'
fi
exec "$venv/bin/python" scripts/anthropic-client.py "$url"
