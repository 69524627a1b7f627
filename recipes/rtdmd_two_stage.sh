#!/usr/bin/env bash
# RTDMD end to end (arXiv 2605.26108): stage 1 distils a 4-step CPS student with AC-DMD; stage 2 fuses it into the base
# (merge_lora, RTDMD's merge_before_training) and trains a fresh LoRA with the hybrid policy gradient (DMDTrainer's
# loss_type rtdmd: PPO on the stochastic CPS steps with group advantages, DMD against the original base at the last).
#   bash recipes/rtdmd_two_stage.sh           # SD3.5 Medium, 8 GPUs: recipes/configs/ac_dmd_sd35.yaml, then rtdmd_sd35.yaml
#   bash recipes/rtdmd_two_stage.sh --tiny    # the tiny offline FLUX on a CPU, brightness
# Arguments after --tiny (or all of them) go to stage 2, e.g. --max_steps 100.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && PATH="$PWD/.venv/bin:$PATH"  # the README's environment, activated or not
if [ "${1:-}" = "--tiny" ]; then
    shift
    [ -f outputs/tiny-flux/model_index.json ] || python -m trl_dance.testing flux outputs/tiny-flux
    trl-dance dmd --config recipes/configs/dmd_flux_tiny.yaml --loss_type ac_dmd --output_dir outputs/rtdmd-student-tiny
    # 16 samples × (1 PPO step + the last) = 32 items: 4 micro-batches, one update per round.
    exec trl-dance dmd --config recipes/configs/dmd_flux_tiny.yaml --loss_type rtdmd \
        --merge_lora outputs/rtdmd-student-tiny --teacher_model_name_or_path outputs/tiny-flux \
        --num_generations 4 --scale_rewards group --policy_gradient_steps 1 --distribution_matching_weight 1e-3 \
        --learning_rate 1e-2 --gradient_accumulation_steps 4 --output_dir outputs/rtdmd-stage2-tiny "$@"
fi
trl-dance dmd --config recipes/configs/ac_dmd_sd35.yaml --accelerate_config ddp --output_dir outputs/ac-dmd-sd35
exec trl-dance dmd --config recipes/configs/rtdmd_sd35.yaml --accelerate_config ddp \
    --merge_lora outputs/ac-dmd-sd35 --output_dir outputs/rtdmd-sd35 "$@"
