"""DiffusionNFT with trl-dance (flow-matching pipelines: FLUX, SD3, Wan): the GRPO script with its trainer.

    trl-dance nft --config recipes/configs/nft_sd3.yaml [--accelerate_config ddp|zero2]
    accelerate launch recipes/nft.py --config recipes/configs/nft_sd3.yaml      # the same script

Any field of DiffusionNFTConfig, trl.ModelConfig or trl_dance/scripts/grpo.py's ScriptArguments can be given in the
YAML file or on the command line; the outputs are the GRPO script's.
"""

from trl_dance import DiffusionNFTConfig, DiffusionNFTTrainer
from trl_dance.scripts import grpo


def make_parser(prog: str | None = None):
    return grpo.make_parser(prog, DiffusionNFTConfig)


def cli() -> DiffusionNFTTrainer:
    return grpo.cli(DiffusionNFTConfig, DiffusionNFTTrainer)


if __name__ == "__main__":
    cli()
