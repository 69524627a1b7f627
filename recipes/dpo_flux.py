"""Diffusion-DPO on FLUX.1-dev (velocity target): recipes/dpo.py with its config.

accelerate launch recipes/dpo_flux.py --config recipes/configs/dpo_flux.yaml
"""

from trl_dance.scripts.dpo import cli

if __name__ == "__main__":
    cli()
