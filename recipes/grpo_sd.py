"""DanceGRPO on Stable Diffusion 1.x/2.x and SDXL (DDIM η, CFG in the loss): recipes/grpo.py with its config.

accelerate launch recipes/grpo_sd.py --config recipes/configs/grpo_sd.yaml
"""

from trl_dance.scripts.grpo import cli

if __name__ == "__main__":
    cli()
