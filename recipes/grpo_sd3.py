"""GRPO on Stable Diffusion 3 / 3.5 with CFG in the loss: recipes/grpo.py with its config.

accelerate launch recipes/grpo_sd3.py --config recipes/configs/grpo_sd3.yaml
"""

from trl_dance.scripts.grpo import cli

if __name__ == "__main__":
    cli()
