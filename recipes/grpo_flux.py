"""DanceGRPO on FLUX.1-dev: recipes/grpo.py with its config.

accelerate launch recipes/grpo_flux.py --config recipes/configs/grpo_flux.yaml
"""

from trl_dance.scripts.grpo import cli

if __name__ == "__main__":
    cli()
