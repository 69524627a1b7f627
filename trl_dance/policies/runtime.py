"""What a trainer sets on a policy for its run, as one object that every copy of the policy shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyRuntime:
    """A run's settings and state beside a policy's sampler settings: where frozen modules live, the
    context-parallel gradient scale, the sampling context's depth, whether decoding clamps. A trainer sets them once
    on its policy's runtime; every copy of the policy (:func:`trl_dance.trainer.evaluation.policy_with`: evaluation
    samplers, training guidance; :func:`~trl_dance.policies.make_policy` with ``runtime``) holds the same object, so
    no copy can run with a different one (a copy that lost ``gradient_scale`` once trained a context-parallel LoRA
    half as far, silently).

    Attributes:
        offload_text_encoders: text encoders on the CPU, on the accelerator only while encoding.
        offload_frozen_expert: two-expert pipelines: the frozen expert on the accelerator only inside ``sampling()``.
        gradient_scale: multiplies the gradient of every denoiser output (context parallelism: each of a group's C
            ranks gets its slice's gradient, and the group's gradients are summed, not averaged: C).
        sampling_depth: nesting of ``sampling()`` contexts (the frozen expert moves at the outermost one).
        unclamped_decode: images decode without the final clamp to [0, 1] (inside ``unclamped_decode()``).
        stream_log_probs: steps return per-stream log-probabilities (B, S) of the policy's ``streams`` (rewards routed
            per modality), not (B,).
        trim_text: encodings cut their masked text padding (the policy's ``padded_text``); off under context
            parallelism, whose plans split the padded length.
    """

    offload_text_encoders: bool = False
    offload_frozen_expert: bool = False
    gradient_scale: float = 1.0
    sampling_depth: int = 0
    unclamped_decode: bool = False
    stream_log_probs: bool = False
    trim_text: bool = True


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_gradient(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """``tensor`` unchanged, its gradient multiplied by ``scale`` in the backward pass."""
    return _ScaleGradient.apply(tensor, scale) if tensor.requires_grad else tensor


__all__ = ["PolicyRuntime", "scale_gradient"]
