"""Diffusion-DPO on SDXL (the paper's recipe): recipes/dpo.py with its config.

accelerate launch recipes/dpo_sdxl.py --config recipes/configs/dpo_sdxl.yaml
"""

from trl_dance.scripts.dpo import cli

if __name__ == "__main__":
    cli()
