"""Train any method on any supported pipeline from a YAML recipe (recipes/configs/), on one process or many.

    accelerate launch recipes/train.py --config recipes/configs/grpo_flux.yaml   # or: trl-dance grpo --config ...

The script is the installed package's trl_dance/scripts/train.py; see its docstring for the options. The other
recipes/*.py files are links to this one, kept for the commands that name them (recipes/grpo_flux.py, ...): the file
name says the method when the YAML does not.
"""

from trl_dance.scripts.train import main

if __name__ == "__main__":
    main()
