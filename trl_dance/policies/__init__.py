"""Model-family adapters behind one interface, :class:`DiffusionPolicy`."""

from __future__ import annotations

from diffusers import (
    DiffusionPipeline,
    FluxPipeline,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    WanImageToVideoPipeline,
    WanPipeline,
)

from .base import Conditioning, DiffusionPolicy, SamplerSettings
from .flow_matching import FlowMatchingPolicy
from .flux import FluxPolicy
from .sd3 import SD3Policy
from .stable_diffusion import StableDiffusionPolicy, StableDiffusionXLPolicy
from .wan import WanImageToVideoPolicy, WanPolicy

_POLICIES: dict[type[DiffusionPipeline], type[DiffusionPolicy]] = {
    FluxPipeline: FluxPolicy,
    StableDiffusion3Pipeline: SD3Policy,
    StableDiffusionXLPipeline: StableDiffusionXLPolicy,
    StableDiffusionPipeline: StableDiffusionPolicy,
    WanPipeline: WanPolicy,
    WanImageToVideoPipeline: WanImageToVideoPolicy,
}


def policy_class(pipeline: DiffusionPipeline) -> type[DiffusionPolicy]:
    """The policy adapter class for a pipeline instance (subclasses of a supported pipeline class included)."""
    for pipeline_class, policy in _POLICIES.items():
        if isinstance(pipeline, pipeline_class):
            return policy
    supported = ", ".join(cls.__name__ for cls in _POLICIES)
    raise TypeError(f"no policy for {type(pipeline).__name__}; supported pipelines: {supported}")


def make_policy(pipeline: DiffusionPipeline, settings: SamplerSettings) -> DiffusionPolicy:
    """The policy adapter for a pipeline instance, sampling with ``settings``."""
    return policy_class(pipeline)(pipeline, settings)


__all__ = [
    "Conditioning",
    "DiffusionPolicy",
    "FlowMatchingPolicy",
    "FluxPolicy",
    "SD3Policy",
    "SamplerSettings",
    "StableDiffusionPolicy",
    "StableDiffusionXLPolicy",
    "WanImageToVideoPolicy",
    "WanPolicy",
    "make_policy",
    "policy_class",
]
