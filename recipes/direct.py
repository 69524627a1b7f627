"""SRPO's Direct-Align and DRaFT-K / AlignProp for flow-matching pipelines (FLUX, SD3).

    accelerate launch recipes/direct.py --config recipes/configs/srpo_flux.yaml   # or: trl-dance direct --config ...

The script is the installed package's trl_dance/scripts/direct.py (`trl-dance direct`); see its docstring for the
options.
"""

from trl_dance.scripts.direct import cli

if __name__ == "__main__":
    cli()
