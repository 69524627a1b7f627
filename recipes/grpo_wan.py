"""DanceGRPO on Wan 2.1 text-to-video with CFG in the loss: recipes/grpo.py with its config.

accelerate launch recipes/grpo_wan.py --config recipes/configs/grpo_wan.yaml
"""

from trl_dance.scripts.grpo import cli

if __name__ == "__main__":
    cli()
