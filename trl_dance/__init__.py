"""trl-dance: reinforcement learning and preference optimization for diffusion models, as TRL trainers."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING

# First: OpenMP's wait policy, before anything loads torch (see _threads.py).
from ._threads import OMP_SPINS  # noqa: F401
from ._torchvision import install_import_hook  # noqa: E402

install_import_hook()  # an installed torchvision is fixed up when first imported (by transformers, say), not here

from .methods import exports  # noqa: E402
from .version import __version__  # noqa: E402


class _TorchvisionFallback(logging.Filter):
    """Drops transformers' notice that an image processor falls back to its PIL backend without torchvision (CPU-only
    torch ships none): the diffusers pipelines import such processors, so every run printed it, and the PIL backend is
    the one trl-dance uses on the CPU anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


logging.getLogger("transformers.utils.import_utils").addFilter(_TorchvisionFallback())

# Public names, imported on first use so `import trl_dance` stays cheap (as in trl): every method's config and
# trainer (trl_dance/methods.py), and the tools below.
_LAZY = {
    **exports(),
    "SDEStepOutput": "trl_dance.sde",
    "flow_sde_step": "trl_dance.sde",
    "ddim_sde_step": "trl_dance.sde",
    "dance_sigmas": "trl_dance.sde",
    "patch_scheduler": "trl_dance.schedulers",
    "get_reward_function": "trl_dance.rewards",
    "register_policy": "trl_dance.policies",
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:  # for editors and type checkers; tests/test_cli.py checks it lists every method of the table
    from .policies import register_policy
    from .rewards import get_reward_function
    from .schedulers import patch_scheduler
    from .sde import SDEStepOutput, dance_sigmas, ddim_sde_step, flow_sde_step
    from .trainer.dance_grpo_config import DanceGRPOConfig
    from .trainer.dance_grpo_trainer import DanceGRPOTrainer
    from .trainer.diffusion_dpo_config import DiffusionDPOConfig
    from .trainer.diffusion_dpo_trainer import DiffusionDPOTrainer
    from .trainer.diffusion_nft_config import DiffusionNFTConfig
    from .trainer.diffusion_nft_trainer import DiffusionNFTTrainer
    from .trainer.diffusion_opd_config import DiffusionOPDConfig
    from .trainer.diffusion_opd_trainer import DiffusionOPDTrainer
    from .trainer.diffusion_sft_config import DiffusionSFTConfig
    from .trainer.diffusion_sft_trainer import DiffusionSFTTrainer
    from .trainer.direct_reward_config import DirectRewardConfig
    from .trainer.direct_reward_trainer import DirectRewardTrainer
    from .trainer.dmd_config import DMDConfig
    from .trainer.dmd_trainer import DMDTrainer
    from .trainer.online_dpo_config import OnlineDiffusionDPOConfig
    from .trainer.online_dpo_trainer import OnlineDiffusionDPOTrainer
    from .trainer.spo_config import SPOConfig
    from .trainer.spo_trainer import SPOTrainer


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_dance' has no attribute {name!r}")
