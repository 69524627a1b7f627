"""DiffusionNFT / AWM / DGPO for flow-matching pipelines (FLUX, SD3, Wan).

    accelerate launch recipes/nft.py --config recipes/configs/nft_sd3.yaml   # or: trl-dance nft --config ...

The script is the installed package's trl_dance/scripts/nft.py (`trl-dance nft`); see its docstring for the options.
"""

from trl_dance.scripts.nft import cli

if __name__ == "__main__":
    cli()
