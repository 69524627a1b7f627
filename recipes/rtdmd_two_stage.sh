#!/usr/bin/env bash
# RTDMD end to end (arXiv 2605.26108): stage 1 distils a few-step student with DMD2 and a reward tilt; stage 2 runs
# GRPO on the distilled student at its own steps, its LoRA fused into the base first (merge_lora, RTDMD's
# merge_before_training), a fresh LoRA trained on the stochastic steps.
#   bash recipes/rtdmd_two_stage.sh           # Qwen-Image, 8 GPUs: 4-step student, then GRPO on HPS v2.1
#   bash recipes/rtdmd_two_stage.sh --tiny    # the tiny offline FLUX on a CPU, brightness
# Arguments after --tiny (or all of them) go to the GRPO stage, e.g. --max_steps 100.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && PATH="$PWD/.venv/bin:$PATH"  # the README's environment, activated or not
if [ "${1:-}" = "--tiny" ]; then
    shift
    [ -f outputs/tiny-flux/model_index.json ] || python -m trl_dance.testing flux outputs/tiny-flux
    trl-dance dmd --config recipes/configs/dmd_flux_tiny.yaml --reward_tilt 1.0 --output_dir outputs/rtdmd-student-tiny
    exec trl-dance grpo --config recipes/configs/grpo_flux_tiny.yaml --merge_lora outputs/rtdmd-student-tiny \
        --num_inference_steps 2 --timestep_fraction 1.0 --gradient_accumulation_steps 2 \
        --output_dir outputs/rtdmd-grpo-tiny "$@"
fi
trl-dance dmd --config recipes/configs/dmd_qwen_image.yaml --accelerate_config ddp --reward_tilt 1.0e-4 \
    --output_dir outputs/rtdmd-student
exec trl-dance grpo --config recipes/configs/grpo_qwen_image.yaml --accelerate_config ddp \
    --merge_lora outputs/rtdmd-student --num_inference_steps 4 --sigma_schedule dance --shift 3.0 \
    --guidance_scale 1.0 --sde_window_range 0 2 --output_dir outputs/rtdmd-grpo "$@"
