"""What a trainer sets on a policy for its run, as one object that every copy of the policy shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PolicyRuntime:
    """A run's settings and state beside a policy's sampler settings: where frozen modules live, the
    context-parallel gradient scale, the sampling context's depth. A trainer sets them once on its policy's runtime;
    :func:`trl_dance.trainer.evaluation.policy_with` (evaluation samplers, training guidance) gives the copy the same
    object, so no copy can run with a different one (a copy that lost ``gradient_scale`` once trained a
    context-parallel LoRA half as far, silently).

    Attributes:
        offload_text_encoders: text encoders on the CPU, on the accelerator only while encoding.
        offload_frozen_expert: two-expert pipelines: the frozen expert on the accelerator only inside ``sampling()``.
        gradient_scale: multiplies the gradient of every denoiser output (context parallelism: each of a group's C
            ranks gets its slice's gradient, and the group's gradients are summed, not averaged: C).
        sampling_depth: nesting of ``sampling()`` contexts (the frozen expert moves at the outermost one).
    """

    offload_text_encoders: bool = False
    offload_frozen_expert: bool = False
    gradient_scale: float = 1.0
    sampling_depth: int = 0


__all__ = ["PolicyRuntime"]
