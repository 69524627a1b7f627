"""Online Diffusion-DPO from AI feedback (pairs regenerated from the current policy, ranked by rewards).

    accelerate launch recipes/online_dpo.py --config recipes/configs/online_dpo_sd3_tiny.yaml   # or: trl-dance online-dpo --config ...

The script is the installed package's trl_dance/scripts/online_dpo.py (`trl-dance online-dpo`); see its docstring for the options.
"""

from trl_dance.scripts.online_dpo import cli

if __name__ == "__main__":
    cli()
