#!/usr/bin/env bash
# The main job: DanceGRPO on the tiny offline FLUX pipeline, on CPU, in about a minute.
# Writes outputs/grpo-flux-tiny/: the LoRA, reward_curve.png and samples.png (before/after training).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
venv="${TRL_DANCE_VENV:-.venv}"  # the environment setup_env.sh made
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
if [ ! -f outputs/tiny-flux/model_index.json ]; then
    "$venv/bin/python" -m trl_dance.testing flux outputs/tiny-flux
fi
exec "$venv/bin/accelerate" launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
    recipes/grpo_flux.py --config recipes/configs/grpo_flux_tiny.yaml "$@"
