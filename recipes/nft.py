"""DiffusionNFT with trl-dance (flow-matching pipelines: FLUX, SD3, Wan): recipes/grpo.py with its trainer.

    accelerate launch recipes/nft.py --config recipes/configs/nft_sd3.yaml

Any field of DiffusionNFTConfig, trl.ModelConfig or grpo.py's ScriptArguments can be given in the YAML file or on the
command line; the outputs are grpo.py's.
"""

from grpo import cli

from trl_dance import DiffusionNFTConfig, DiffusionNFTTrainer

if __name__ == "__main__":
    cli(DiffusionNFTConfig, DiffusionNFTTrainer)
