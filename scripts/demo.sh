#!/usr/bin/env bash
# The main job: the real task on a CPU, in about 13 minutes. DiffusionNFT trains the shipped text model (a
# StableDiffusion3Pipeline this project trained to render words, trl_dance/text_task/model) against an OCR reward
# (PP-OCRv4) for 20 rounds; 200 words held out of all training are judged before and after by PP-OCR and by EasyOCR,
# an engine training never sees. Writes outputs/nft-ocr-demo/: the LoRA, reward_curve.png and samples.png (held-out
# words before/after training, same seeds). Extra arguments go to the recipe (e.g. --max_steps 50 --eval_steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh ocr
venv="${TRL_DANCE_VENV:-.venv}"  # the environment setup_env.sh made
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
"$venv/bin/trl-dance" nft --config recipes/configs/nft_ocr_tiny.yaml --output_dir outputs/nft-ocr-demo \
    --max_steps 100 --eval_steps 100 "$@"
echo "ocr = PP-OCRv4, the reward; ocr_easyocr = EasyOCR, the held-out judge (eval_judges/ocr_easyocr/mean is its edit score)."
echo "exact: the share of the 200 held-out words read exactly; edit: Flow-GRPO's 1 - edit distance / length."
