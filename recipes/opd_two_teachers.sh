#!/usr/bin/env bash
# DiffusionOPD end to end: two teachers, each trained on one reward by an existing trainer, distilled into one student
# along its own rollouts (each prompt toward its task's teacher).
#   bash recipes/opd_two_teachers.sh           # FLUX.1-dev on 8 GPUs: GRPO on HPS v2.1, DiffusionNFT on PickScore
#   bash recipes/opd_two_teachers.sh --tiny    # the tiny offline FLUX on a CPU: brightness, JPEG compressibility
# Arguments after --tiny (or all of them) go to the distillation run, e.g. --max_steps 100.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && PATH="$PWD/.venv/bin:$PATH"  # the README's environment, activated or not
if [ "${1:-}" = "--tiny" ]; then
    shift
    [ -f outputs/tiny-flux/model_index.json ] || python -m trl_dance.testing flux outputs/tiny-flux
    trl-dance grpo --config recipes/configs/grpo_flux_tiny.yaml --max_steps 30 --output_dir outputs/teacher-bright-tiny
    trl-dance nft --config recipes/configs/nft_flux_tiny.yaml --reward_funcs jpeg_compressibility \
        --output_dir outputs/teacher-compressible-tiny
    exec trl-dance opd --config recipes/configs/opd_flux_tiny.yaml "$@"
fi
launch=(accelerate launch --config_file trl_dance/accelerate_configs/ddp.yaml recipes/train.py)
"${launch[@]}" --config recipes/configs/grpo_flux.yaml --output_dir outputs/teacher-hps
"${launch[@]}" --config recipes/configs/nft_flux.yaml --reward_funcs pickscore --output_dir outputs/teacher-pickscore
exec "${launch[@]}" --config recipes/configs/opd_flux.yaml "$@"
