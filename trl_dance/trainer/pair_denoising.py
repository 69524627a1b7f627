"""Diffusion-DPO's forward process on preference pairs, shared by the offline and the online trainer.

A pair's two clean latents (chosen w, rejected l) are noised with one noise and one time; the per-sample denoising
errors of the policy and of the reference give TRL's DPO losses in the implicit rewards β·r = −β/2·(e_θ − e_ref).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..forward_process import TimeDensity
from ..losses import DPO_LOSS_TYPES, dpo_losses
from ..policies import DiffusionPolicy

_SCHEMES = ("none", "logit_normal", "mode")


@dataclass
class TimeDensityArguments:
    """The density of training times of the losses on noised real images (Diffusion-DPO, SFT); documented in
    :class:`~trl_dance.DiffusionDPOConfig`."""

    weighting_scheme: str = field(
        default="none",
        metadata={"help": "Flow models' timestep density: none | logit_normal | mode.", "choices": list(_SCHEMES)},
    )
    logit_mean: float = field(default=0.0, metadata={"help": "Mean of the logit-normal density."})
    logit_std: float = field(default=1.0, metadata={"help": "Std of the logit-normal density."})
    mode_scale: float = field(default=1.29, metadata={"help": "Scale of the 'mode' density."})

    def _check_time_density(self) -> None:
        if self.weighting_scheme not in _SCHEMES:
            raise ValueError(f"weighting_scheme must be one of {list(_SCHEMES)}, got {self.weighting_scheme!r}")

    def time_density(self) -> TimeDensity:
        return TimeDensity(self.weighting_scheme, self.logit_mean, self.logit_std, self.mode_scale)


@dataclass
class DPOLossArguments(TimeDensityArguments):
    """The Diffusion-DPO loss settings (documented in :class:`~trl_dance.DiffusionDPOConfig`)."""

    beta: float = field(default=5000.0, metadata={"help": "DPO β (5000 for SD1.5/SDXL; ~100 for flow models)."})
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"], metadata={"help": f"TRL DPO loss types: {', '.join(DPO_LOSS_TYPES)}."}
    )
    loss_weights: list[float] | None = field(default=None, metadata={"help": "One weight per loss type."})
    label_smoothing: float = field(default=0.0, metadata={"help": "Label flip probability (robust, exo_pair)."})

    def _check_dpo_loss(self) -> None:
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        unknown = [kind for kind in self.loss_type if kind not in DPO_LOSS_TYPES]
        if unknown or not self.loss_type:
            raise ValueError(f"loss_type must be a list of {list(DPO_LOSS_TYPES)}, got {self.loss_type!r}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"loss_weights must have one weight per loss_type: {len(self.loss_weights)} weights for "
                f"{self.loss_type}"
            )
        if "robust" in self.loss_type and not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"the robust loss needs label_smoothing in [0, 0.5), got {self.label_smoothing}")
        if "exo_pair" in self.loss_type and not 0 < self.label_smoothing < 1:
            raise ValueError(
                f"the exo_pair loss needs label_smoothing in (0, 1), e.g. 1e-3; got {self.label_smoothing}"
            )
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        self._check_time_density()
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"beta must be a positive number, got {self.beta}")

    @property
    def needs_reference(self) -> bool:
        """Whether a loss type compares with the reference (all but ``sft``)."""
        return any(kind != "sft" for kind in self.loss_type)


class PairDenoising:
    """Noise, times, targets and errors of preference pairs for one policy and one :class:`DPOLossArguments`, through
    the policy's forward process (``policy.process``: ``sample_training_times``, ``add_noise``, ``training_target``):
    flow models σ on the model's training grid, drawn with ``weighting_scheme``'s density; ε/v models a uniform
    training timestep."""

    def __init__(self, policy: DiffusionPolicy, args: DPOLossArguments):
        self.policy, self.args = policy, args
        self.density = args.time_density()

    def draw(self, shape: tuple[int, ...], generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per pair a noise (P, ...) and a time (P,) of the forward process."""
        noise = torch.randn(shape, generator=generator, device=device)
        return noise, self.policy.process.sample_training_times(shape[0], generator, device, self.density)

    def draw_per_pair(self, shape: tuple[int, ...], generators: list[torch.Generator], device):
        """:meth:`draw` with pair ``b``'s noise and time from the CPU generator ``generators[b]`` (independent of
        batching)."""
        per_pair = [self.draw((1, *shape[1:]), g, "cpu") for g in generators]
        return tuple(torch.cat(part).to(device) for part in zip(*per_pair))

    def noised(self, latents: torch.Tensor, noise: torch.Tensor, time: torch.Tensor):
        """The 2P noisy latents of ``latents`` (2P, ...) ordered w0, l0, w1, l1, ... (each pair's noise (P, ...) and
        time (P,) shared by its two samples), their target and their times (2P,)."""
        noise, time = noise.repeat_interleave(2, dim=0), time.repeat_interleave(2)
        process = self.policy.process
        return process.add_noise(latents, noise, time), process.training_target(latents, noise, time), time

    def errors(self, trainer, model, latents: torch.Tensor, cond: dict, draws: tuple[torch.Tensor, torch.Tensor]):
        """Per-sample errors (2P,) float32 of the policy and of ``trainer``'s reference (None when no loss type needs
        it), and the policy's prediction, for pairs of clean ``latents`` (2P, ...) conditioned by ``cond`` (2P rows)."""
        noisy, target, time = self.noised(latents, *draws)
        dims = tuple(range(1, latents.ndim))
        prediction = self.policy.predict(model, noisy, cond, at=time)
        errors = ((prediction - target.float()) ** 2).mean(dim=dims)
        ref_errors = None
        if self.args.needs_reference:
            reference = trainer.reference_prediction(model, noisy, cond, time)
            ref_errors = ((reference - target.float()) ** 2).mean(dim=dims)
        return errors, ref_errors, prediction

    def losses(self, errors: torch.Tensor, ref_errors: torch.Tensor | None, weights: torch.Tensor):
        """Per-pair losses (P,), implicit rewards β·r_w and β·r_l (P,), and the implicit accuracy (P,): 1 if the
        chosen sample's reward is higher, ½ for a tie or z = 0 exactly (policy = reference)."""
        args = self.args
        ref = (None, None) if ref_errors is None else (ref_errors[0::2], ref_errors[1::2])
        losses, chosen, rejected = dpo_losses(
            errors[0::2],
            errors[1::2],
            *ref,
            args.beta,
            args.loss_type,
            args.loss_weights,
            args.label_smoothing,
            weights,
        )
        z = chosen - rejected
        correct = torch.where(z == 0, torch.full_like(z, 0.5), (z > 0).float())
        return losses, chosen, rejected, torch.where(weights < 1, torch.full_like(z, 0.5), correct)


def reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor, correct: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's DPO metric names, and this package's first names (``implicit_acc``, ``margin``) beside them."""
    margin = chosen - rejected
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracies": correct,
        "rewards/margins": margin,
        "implicit_acc": correct,
        "margin": margin,
    }
