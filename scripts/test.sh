#!/usr/bin/env bash
# Runs the whole test suite on CPU in ./.venv (created and installed on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -n auto "$@"
