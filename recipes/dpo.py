"""Diffusion-DPO on image preference pairs, for SD1.x/2.x, SDXL, SD3 and FLUX.

    accelerate launch recipes/dpo.py --config recipes/configs/dpo_sdxl.yaml   # or: trl-dance dpo --config ...

The script is the installed package's trl_dance/scripts/dpo.py (`trl-dance dpo`); see its docstring for the options.
"""

from trl_dance.scripts.dpo import cli

if __name__ == "__main__":
    cli()
