"""DanceGRPO on Stable Diffusion 3 / 3.5: the same recipe as grpo_flux.py, which dispatches on the pipeline class.

accelerate launch recipes/grpo_sd3.py --config recipes/configs/grpo_sd3.yaml
"""

from grpo_flux import DanceGRPOConfig, ModelConfig, ScriptArguments, TrlParser, main

if __name__ == "__main__":
    main(*TrlParser((ScriptArguments, DanceGRPOConfig, ModelConfig)).parse_args_and_config())
