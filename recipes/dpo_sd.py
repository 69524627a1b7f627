"""Diffusion-DPO on Stable Diffusion 1.5: recipes/dpo.py with its config.

accelerate launch recipes/dpo_sd.py --config recipes/configs/dpo_sd.yaml
"""

from trl_dance.scripts.dpo import cli

if __name__ == "__main__":
    cli()
