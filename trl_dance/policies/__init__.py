"""Model-family adapters behind one interface, :class:`DiffusionPolicy`, found by pipeline class."""

from __future__ import annotations

from diffusers import (
    DiffusionPipeline,
    Flux2KleinPipeline,
    Flux2Pipeline,
    FluxKontextPipeline,
    FluxPipeline,
    HunyuanSkyreelsImageToVideoPipeline,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideoPipeline,
    LTX2ConditionPipeline,
    LTX2ImageToVideoPipeline,
    LTX2Pipeline,
    MiniMaxH3ModularPipeline,
    ModularPipeline,
    QwenImage21Pipeline,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    ZImagePipeline,
)

from .base import At, Conditioning, DiffusionPolicy
from .flux import Flux2KleinPolicy, Flux2Policy, FluxKontextPolicy, FluxPolicy
from .hunyuan_video import HunyuanSkyreelsImageToVideoPolicy, HunyuanVideoPolicy
from .hunyuan_video15 import HunyuanVideo15ImageToVideoPolicy, HunyuanVideo15Policy
from .layout import (
    OneFrameLatents,
    PackedLatents,
    PatchifiedLatents,
    RGBAOneFrameLatents,
    SpatialLatents,
    VideoLatents,
)
from .ltx2 import LTX2ConditionPolicy, LTX2ImageToVideoPolicy, LTX2Policy
from .minimax_h3 import MiniMaxH3Policy
from .process import DiffusionProcess, FlowProcess, StreamFlowProcess, VPProcess, require_flow
from .qwen_image import QwenImageEditPlusPolicy, QwenImageEditPolicy, QwenImagePolicy
from .qwen_image21 import QwenImage21Policy
from .runtime import PolicyRuntime
from .sd3 import SD3Policy
from .settings import SamplerSettings
from .stable_diffusion import StableDiffusionPolicy, StableDiffusionXLPolicy
from .wan import WanImageToVideoPolicy, WanPolicy
from .z_image import ZImagePolicy

_POLICIES: dict[type[DiffusionPipeline], type[DiffusionPolicy]] = {}


def register_policy(pipeline_class: type[DiffusionPipeline], policy_class: type[DiffusionPolicy]) -> None:
    """Train pipelines of ``pipeline_class`` (and of its subclasses without a registration of their own) with
    ``policy_class``, a :class:`DiffusionPolicy` subclass. Registering a class again replaces its policy.

    Example::

        from diffusers import FluxPipeline
        from trl_dance import register_policy
        from trl_dance.policies import FluxPolicy

        class MyFluxPipeline(FluxPipeline): ...

        class MyFluxPolicy(FluxPolicy):
            def _encode(self, prompts, negative=False):
                ...  # the pipeline's own text conditioning

        register_policy(MyFluxPipeline, MyFluxPolicy)

    Raises:
        TypeError if either argument is not such a class.
    """
    if not (isinstance(pipeline_class, type) and issubclass(pipeline_class, (DiffusionPipeline, ModularPipeline))):
        raise TypeError(
            f"pipeline_class must be a diffusers DiffusionPipeline or ModularPipeline subclass, got {pipeline_class!r}"
        )
    if not (isinstance(policy_class, type) and issubclass(policy_class, DiffusionPolicy)):
        raise TypeError(f"policy_class must be a trl_dance.policies.DiffusionPolicy subclass, got {policy_class!r}")
    _POLICIES[pipeline_class] = policy_class


for _pipeline, _policy in (
    (FluxPipeline, FluxPolicy),
    (FluxKontextPipeline, FluxKontextPolicy),
    (Flux2Pipeline, Flux2Policy),
    (Flux2KleinPipeline, Flux2KleinPolicy),
    (QwenImagePipeline, QwenImagePolicy),
    (QwenImageEditPipeline, QwenImageEditPolicy),
    (QwenImageEditPlusPipeline, QwenImageEditPlusPolicy),
    (QwenImage21Pipeline, QwenImage21Policy),
    (HunyuanVideoPipeline, HunyuanVideoPolicy),
    (HunyuanSkyreelsImageToVideoPipeline, HunyuanSkyreelsImageToVideoPolicy),
    (HunyuanVideo15Pipeline, HunyuanVideo15Policy),
    (HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15ImageToVideoPolicy),
    (LTX2ConditionPipeline, LTX2ConditionPolicy),
    (LTX2ImageToVideoPipeline, LTX2ImageToVideoPolicy),
    (LTX2Pipeline, LTX2Policy),
    (MiniMaxH3ModularPipeline, MiniMaxH3Policy),
    (StableDiffusion3Pipeline, SD3Policy),
    (StableDiffusionXLPipeline, StableDiffusionXLPolicy),
    (StableDiffusionPipeline, StableDiffusionPolicy),
    (WanPipeline, WanPolicy),
    (WanImageToVideoPipeline, WanImageToVideoPolicy),
    (ZImagePipeline, ZImagePolicy),
):
    register_policy(_pipeline, _policy)


def policy_class(pipeline: DiffusionPipeline) -> type[DiffusionPolicy]:
    """The policy class registered for the pipeline's class, or for its nearest registered base class."""
    for cls in type(pipeline).__mro__:
        if cls in _POLICIES:
            return _POLICIES[cls]
    supported = ", ".join(sorted(cls.__name__ for cls in _POLICIES))
    raise TypeError(
        f"no policy for {type(pipeline).__name__}; supported pipelines: {supported}. Add one with "
        f"trl_dance.register_policy({type(pipeline).__name__}, YourPolicy) (a trl_dance.policies.DiffusionPolicy "
        "subclass; see docs/add-a-model-family.md)"
    )


def make_policy(
    pipeline: DiffusionPipeline, settings: SamplerSettings, runtime: PolicyRuntime | None = None
) -> DiffusionPolicy:
    """The policy adapter for a pipeline instance, sampling with ``settings``; with ``runtime``, sharing that run's
    runtime (another policy's, so that both run with the same settings and state)."""
    policy = policy_class(pipeline)(pipeline, settings)
    if runtime is not None:
        policy.runtime = runtime
    return policy


__all__ = [
    "At",
    "Conditioning",
    "DiffusionPolicy",
    "DiffusionProcess",
    "FlowProcess",
    "OneFrameLatents",
    "PackedLatents",
    "PatchifiedLatents",
    "PolicyRuntime",
    "RGBAOneFrameLatents",
    "SpatialLatents",
    "StreamFlowProcess",
    "VPProcess",
    "VideoLatents",
    "require_flow",
    "Flux2KleinPolicy",
    "Flux2Policy",
    "FluxKontextPolicy",
    "FluxPolicy",
    "HunyuanSkyreelsImageToVideoPolicy",
    "HunyuanVideo15ImageToVideoPolicy",
    "HunyuanVideo15Policy",
    "HunyuanVideoPolicy",
    "LTX2ConditionPolicy",
    "LTX2ImageToVideoPolicy",
    "LTX2Policy",
    "MiniMaxH3Policy",
    "QwenImage21Policy",
    "QwenImageEditPlusPolicy",
    "QwenImageEditPolicy",
    "QwenImagePolicy",
    "SD3Policy",
    "SamplerSettings",
    "StableDiffusionPolicy",
    "StableDiffusionXLPolicy",
    "WanImageToVideoPolicy",
    "WanPolicy",
    "ZImagePolicy",
    "make_policy",
    "policy_class",
    "register_policy",
]
