#!/usr/bin/env bash
# Runs the whole test suite on CPU in ./.venv (or $TRL_DANCE_VENV) (created and installed on first use, with DeepSpeed for the
# ZeRO-2/ZeRO-3 tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev,deepspeed
venv="${TRL_DANCE_VENV:-.venv}"  # the environment setup_env.sh made
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
# worksteal: an idle worker takes queued tests from the busy one (the slow learning runs otherwise leave a tail).
exec "$venv/bin/python" -m pytest -n auto --dist worksteal "$@"
