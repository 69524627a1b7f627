"""Configuration of :class:`~trl_dance.OnlineDiffusionDPOTrainer`."""

from dataclasses import dataclass, field

from .pair_denoising import DPOLossArguments
from .rollout_config import RolloutConfig


@dataclass
class OnlineDiffusionDPOConfig(DPOLossArguments, RolloutConfig):
    r"""
    Configuration for [`OnlineDiffusionDPOTrainer`]: Diffusion-DPO on pairs regenerated from the current policy and
    ranked by reward functions (learning from AI feedback, Diffusion-DPO §5.3; TRL's `OnlineDPOTrainer` for diffusion).

    Each round, every prompt gets `num_generations` samples from the deterministic sampler (ODE / DDIM η = 0, each
    from its own initial noise, CFG as `guidance_scale` says); the rewards' weighted sum ranks them, and the best and
    the worst form the prompt's pair. The round's pairs are trained for `num_iterations` passes (fresh noise and time
    per pass), so pairs are regenerated every `steps_per_generation × num_iterations` micro-steps. The loss is the
    Diffusion-DPO loss of [`DiffusionDPOConfig`] (its `beta`, `loss_type`, `loss_weights`, `label_smoothing`,
    `weighting_scheme`, `logit_mean`, `logit_std`, `mode_scale`) on the prediction the sampler uses, against the
    LoRA-disabled base (a frozen copy for full fine-tuning).

    Units. ``per_device_train_batch_size`` counts pairs; each process holds whole groups, so a round has
    ``generation_batch_size / (num_processes · num_generations) / per_device_train_batch_size`` micro-batches.

    Parameters:
        beta (`float`, defaults to `5000.0`): DPO's β (not a KL coefficient here): 2000–5000 for SD1.5/SDXL, ~100–500
            for flow models.
        min_margin (`float`, defaults to `0.0`): A pair whose reward gap (best − worst) is below this, or zero, is not
            trained (its loss is masked; the fraction kept is logged as `pairs/kept`).
        share_initial_noise (`str`, defaults to `"none"`): Deterministic rollouts from a shared start would give
            identical samples: must be `"none"`.
        Generation, reward and model fields: [`~trl_dance.trainer.rollout_config.RolloutConfig`].
    """

    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate."})
    beta: float = field(default=5000.0, metadata={"help": "DPO β (5000 for SD1.5/SDXL; ~100-500 for flow models)."})
    num_generations: int = field(default=4, metadata={"help": "Samples per prompt ranked into one pair."})
    per_device_train_batch_size: int = field(default=1, metadata={"help": "Pairs per micro-batch per process."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer update."})
    share_initial_noise: str = field(
        default="none",
        metadata={"help": "none: every sample its own initial noise (deterministic rollouts).", "choices": ["none"]},
    )
    min_margin: float = field(default=0.0, metadata={"help": "Smallest reward gap of a trained pair."})

    def _check_method(self) -> None:
        self._check_dpo_loss()
        if self.share_initial_noise != "none":
            raise ValueError(
                f"share_initial_noise={self.share_initial_noise!r}: deterministic rollouts from a shared initial noise "
                "make a group's samples identical; online Diffusion-DPO needs share_initial_noise='none'"
            )
        if self.min_margin < 0:
            raise ValueError(f"min_margin must be >= 0, got {self.min_margin}")
        self._check_whole_groups("online Diffusion-DPO ranks")

    def _round_items(self) -> tuple[int, str]:
        pairs = self.per_device_generation_batch_size // self.num_generations
        return pairs, f"{pairs} pairs (one per prompt)"
