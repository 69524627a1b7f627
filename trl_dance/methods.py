"""The table of training methods: one row per method feeds the package's exports (``trl_dance.DanceGRPOTrainer``), the
``trl-dance`` subcommands and the one training script (``trl_dance/scripts/train.py``, ``recipes/train.py``).

Adding a method: its config and trainer modules under ``trl_dance/trainer/``, one row here, its names in
``trl_dance/__init__.py``'s ``TYPE_CHECKING`` block (for editors; a test checks it matches), and its docs. Strings
only: importing this module imports nothing heavy.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """One training method.

    Attributes:
        name: the ``trl-dance`` subcommand and the recipes' ``command:`` key.
        config: ``"module:Class"`` of its config.
        trainer: ``"module:Class"`` of its trainer.
        data: what the script trains on: ``"prompts"`` (rollouts scored by ``reward_funcs``; script arguments of
            :mod:`trl_dance.scripts.from_rollouts`) or ``"dataset"`` (a dataset of images; :mod:`trl_dance.scripts.from_dataset`).
        help: one line for ``trl-dance --help``.
        aliases: other names the script accepts for it (recipe file names such as ``ddpo_sd.py``).
    """

    name: str
    config: str
    trainer: str
    data: str
    help: str
    aliases: tuple[str, ...] = ()

    @property
    def config_class(self) -> type:
        return _load(self.config)

    @property
    def trainer_class(self) -> type:
        return _load(self.trainer)


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


_T = "trl_dance.trainer."
METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        Method(
            "grpo",
            _T + "dance_grpo_config:DanceGRPOConfig",
            _T + "dance_grpo_trainer:DanceGRPOTrainer",
            "prompts",
            "DanceGRPO / Flow-GRPO / MixGRPO / DDPO",
            aliases=("ddpo",),
        ),
        Method(
            "nft",
            _T + "diffusion_nft_config:DiffusionNFTConfig",
            _T + "diffusion_nft_trainer:DiffusionNFTTrainer",
            "prompts",
            "DiffusionNFT / AWM / DGPO / DiffusionART (flow-matching models)",
        ),
        Method(
            "dpo",
            _T + "diffusion_dpo_config:DiffusionDPOConfig",
            _T + "diffusion_dpo_trainer:DiffusionDPOTrainer",
            "dataset",
            "Diffusion-DPO on image and video preference pairs",
        ),
        Method(
            "sft",
            _T + "diffusion_sft_config:DiffusionSFTConfig",
            _T + "diffusion_sft_trainer:DiffusionSFTTrainer",
            "dataset",
            "supervised fine-tuning on captioned images or videos",
        ),
        Method(
            "online-dpo",
            _T + "online_dpo_config:OnlineDiffusionDPOConfig",
            _T + "online_dpo_trainer:OnlineDiffusionDPOTrainer",
            "prompts",
            "online Diffusion-DPO on pairs ranked by rewards (AI feedback)",
            aliases=("online_dpo",),
        ),
        Method(
            "spo",
            _T + "spo_config:SPOConfig",
            _T + "spo_trainer:SPOTrainer",
            "prompts",
            "SPO: step-aware preference optimization on candidate pools",
        ),
        Method(
            "opd",
            _T + "diffusion_opd_config:DiffusionOPDConfig",
            _T + "diffusion_opd_trainer:DiffusionOPDTrainer",
            "prompts",
            "DiffusionOPD: task teachers (LoRAs) distilled into one student on its rollouts",
        ),
        Method(
            "direct",
            _T + "direct_reward_config:DirectRewardConfig",
            _T + "direct_reward_trainer:DirectRewardTrainer",
            "prompts",
            "SRPO's Direct-Align / DRaFT-K / AlignProp (differentiable rewards)",
            aliases=("srpo", "draft", "alignprop"),
        ),
        Method(
            "dmd",
            _T + "dmd_config:DMDConfig",
            _T + "dmd_trainer:DMDTrainer",
            "prompts",
            "DMD2 few-step distillation (flow-matching models), RTDMD's reward tilt",
            aliases=("dmd2", "rtdmd"),
        ),
    )
}


def get_method(name: str) -> Method:
    """The method named ``name`` or one of its aliases (``-`` and ``_`` alike); ``ValueError`` listing them if none."""
    key = name.replace("_", "-")
    for method in METHODS.values():
        if key == method.name or key in (alias.replace("_", "-") for alias in method.aliases):
            return method
    raise ValueError(f"unknown method {name!r}: one of {', '.join(METHODS)}")


def exports() -> dict[str, str]:
    """Every method's public config and trainer names → their modules (``trl_dance``'s lazy exports)."""
    names = {}
    for method in METHODS.values():
        for path in (method.config, method.trainer):
            module, name = path.split(":")
            names[name] = module
    return names
