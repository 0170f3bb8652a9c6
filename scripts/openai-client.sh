#!/usr/bin/env bash
# Runs scripts/openai-client.py against a running `encore serve` at URL,
# with the official `openai` client from PyPI installed into a virtual
# environment (kept in target/openai-venv, made on first use).
#
#   scripts/openai-client.sh http://127.0.0.1:8080
set -euo pipefail
cd "$(dirname "$0")/.."
url=${1:?usage: scripts/openai-client.sh URL}
venv=${OPENAI_VENV:-target/openai-venv}
if [[ ! -x $venv/bin/python ]]; then
    python3 -m venv "$venv" || {
        echo "python3 -m venv failed: install python3-venv (Debian)" >&2
        exit 1
    }
fi
if ! "$venv/bin/python" -c 'import openai' 2>/dev/null; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check 'openai>=1.40,<3'
fi
exec "$venv/bin/python" scripts/openai-client.py "$url"
