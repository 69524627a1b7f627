"""SPO (step-aware preference optimization; SD1.x/SDXL with DDIM-η, flow models with the SDE): the GRPO script with its trainer.

    trl-dance spo --config recipes/configs/spo_sd_tiny.yaml [--accelerate_config ddp|zero2]
    accelerate launch recipes/spo.py --config recipes/configs/spo_sd_tiny.yaml      # the same script

Any field of SPOConfig, trl.ModelConfig or trl_dance/scripts/grpo.py's ScriptArguments can be given in the YAML file or
on the command line; the outputs are the GRPO script's.
"""

from trl_dance import SPOConfig, SPOTrainer
from trl_dance.scripts import grpo


def make_parser(prog: str | None = None):
    return grpo.make_parser(prog, SPOConfig)


def cli() -> SPOTrainer:
    return grpo.cli(SPOConfig, SPOTrainer)


if __name__ == "__main__":
    cli()
