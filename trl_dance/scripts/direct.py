"""SRPO's Direct-Align and DRaFT-K / AlignProp with trl-dance (flow-matching pipelines: FLUX, SD3): the GRPO script
with DirectRewardTrainer.

    trl-dance direct --config recipes/configs/srpo_flux.yaml [--accelerate_config ddp|zero2]
    accelerate launch recipes/direct.py --config recipes/configs/srpo_flux.yaml      # the same script

Any field of DirectRewardConfig, trl.ModelConfig or trl_dance/scripts/grpo.py's ScriptArguments can be given in the
YAML file or on the command line; the rewards must be differentiable (hpsv2, pickscore, clip_score, image_reward,
aesthetic, brightness); the outputs are the GRPO script's.
"""

from trl_dance import DirectRewardConfig, DirectRewardTrainer
from trl_dance.scripts import grpo


def make_parser(prog: str | None = None):
    return grpo.make_parser(prog, DirectRewardConfig)


def cli() -> DirectRewardTrainer:
    return grpo.cli(DirectRewardConfig, DirectRewardTrainer)


if __name__ == "__main__":
    cli()
