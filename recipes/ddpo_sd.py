"""DDPO (per-prompt statistics, JPEG compressibility / aesthetic rewards) on Stable Diffusion: recipes/grpo.py with its config.

accelerate launch recipes/ddpo_sd.py --config recipes/configs/ddpo_sd.yaml
"""

from trl_dance.scripts.grpo import cli

if __name__ == "__main__":
    cli()
