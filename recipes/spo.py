"""SPO (step-aware preference optimization; SD1.x/SDXL with DDIM-η, flow models with the SDE).

    accelerate launch recipes/spo.py --config recipes/configs/spo_sd_tiny.yaml   # or: trl-dance spo --config ...

The script is the installed package's trl_dance/scripts/spo.py (`trl-dance spo`); see its docstring for the options.
"""

from trl_dance.scripts.spo import cli

if __name__ == "__main__":
    cli()
