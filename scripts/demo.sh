#!/usr/bin/env bash
# The main job: DanceGRPO teaches the shipped text model (a small SD3 pipeline trained by this project to render words)
# to spell, rewarded by PP-OCR and judged on 200 held-out words by PP-OCR and EasyOCR before and after, on the CPU.
# Writes outputs/grpo-ocr-tiny/: the LoRA, reward_curve.png and samples.png (held-out words before/after training).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh ocr
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
exec .venv/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
    recipes/grpo_sd3.py --config recipes/configs/grpo_ocr_tiny.yaml "$@"
