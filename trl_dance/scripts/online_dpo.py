"""Online Diffusion-DPO from AI feedback (pairs regenerated from the current policy, ranked by rewards): the GRPO script with its trainer.

    trl-dance online-dpo --config recipes/configs/online_dpo_sd3_tiny.yaml [--accelerate_config ddp|zero2]
    accelerate launch recipes/online_dpo.py --config recipes/configs/online_dpo_sd3_tiny.yaml      # the same script

Any field of OnlineDiffusionDPOConfig, trl.ModelConfig or trl_dance/scripts/grpo.py's ScriptArguments can be given in the YAML file or
on the command line; the outputs are the GRPO script's.
"""

from trl_dance import OnlineDiffusionDPOConfig, OnlineDiffusionDPOTrainer
from trl_dance.scripts import grpo


def make_parser(prog: str | None = None):
    return grpo.make_parser(prog, OnlineDiffusionDPOConfig)


def cli() -> OnlineDiffusionDPOTrainer:
    return grpo.cli(OnlineDiffusionDPOConfig, OnlineDiffusionDPOTrainer)


if __name__ == "__main__":
    cli()
