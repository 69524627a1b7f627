"""DanceGRPO (and DDPO) for any supported pipeline: FLUX, SD3, SD1.x/2.x, SDXL, Wan (video).

    accelerate launch recipes/grpo.py --config recipes/configs/grpo_flux.yaml   # or: trl-dance grpo --config ...

The script is the installed package's trl_dance/scripts/grpo.py (`trl-dance grpo`); see its docstring for the options.
"""

from trl_dance.scripts.grpo import cli

if __name__ == "__main__":
    cli()
