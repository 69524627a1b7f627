"""Speed options that keep training exact: regional ``torch.compile`` of the denoiser and diffusers' attention
backends, applied to every copy of the denoiser the trainer calls (the trained one, a frozen expert, a reference)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Rollout accelerators that skip or approximate denoiser calls (diffusers' caches: FirstBlockCache, FasterCache,
# TaylorSeer, ...) change the distribution the rollouts come from, so a ratio against the trained forward is off.
LOSSY_CACHE = (
    "{name} has a diffusers cache enabled ({model}.enable_cache): it approximates denoiser calls, so rollouts no longer "
    "come from the policy that {trainer}'s likelihood ratio differentiates; call {model}.disable_cache() first"
)


@dataclass
class SpeedArguments:
    r"""
    Speed options, on every trainer's config (with transformers' `torch_compile`, `torch_compile_backend` and
    `torch_compile_mode`, which here compile the denoiser *regionally*: each repeated transformer block once, with
    diffusers' `compile_repeated_blocks`, in place so that rollouts, old/reference and training forwards all run it;
    a family that declares no repeated blocks has its longest list of blocks compiled one by one). `torch_compile`
    defaults to None here: on for a CUDA device whose parameters are not sharded (FSDP, ZeRO-3), off elsewhere; `False`
    turns it off.

    Parameters:
        attention_backend (`str` or `None`, defaults to `"auto"`): diffusers' attention backend for the denoiser
            (`model.set_attention_backend`): `"native"` (PyTorch SDPA), `"_native_cudnn"`, `"flash"`,
            `"_flash_3_hub"`, `"sage"`, `"_native_math"`, ... (`diffusers.models.attention_dispatch.
            AttentionBackendName`); None keeps the model's default. `"auto"`: `"_native_cudnn"` on a CUDA GPU of
            compute capability 9.0 or more (Hopper, Blackwell) for a model whose attention goes through diffusers'
            dispatcher and masks no text tokens, else the model's default (masked attention stays off cuDNN: its
            masked backward has a known NaN bug in torch 2.11–2.13, pytorch/pytorch#196678). On an H200 (torch 2.11,
            cuDNN 9.19) cuDNN's kernel ran the forward and backward of FLUX.1-dev's and Wan 14B's attention 1.6–1.9x
            faster than SDPA's default (flash) kernel, with the same error against float32
            (`benchmarks/attention_kernels.py`). Rollouts and training run the same backend, so the first update of a
            round stays on-policy.
        cudnn_attention (`bool`, defaults to `False`): let PyTorch's SDPA pick its cuDNN kernel in calls that do not
            go through diffusers' dispatcher (SD3, SD UNets; a backend set above chooses its kernel itself). Off for
            the whole process by default: its backward once made an illegal memory access on FLUX.1-dev (head
            dimension 128, 1,536 tokens, H200) that has not recurred since (the same shapes alone, and whole FLUX
            1024² rounds through `"_native_cudnn"`).
    """

    torch_compile: bool | None = field(
        default=None,
        metadata={"help": "Compile the denoiser regionally (default: on for an unsharded CUDA run, else off)."},
    )

    attention_backend: str | None = field(
        default="auto",
        metadata={"help": "diffusers attention backend of the denoiser (auto, native, _native_cudnn, flash, ...)."},
    )

    cudnn_attention: bool = field(
        default=False, metadata={"help": "let PyTorch's SDPA use its cuDNN kernel (off: it crashed FLUX's backward)."}
    )

    def _check_speed(self) -> None:
        if self.attention_backend in (None, "auto"):
            return
        from diffusers.models.attention_dispatch import AttentionBackendName

        names = [backend.value for backend in AttentionBackendName]
        if self.attention_backend not in names:
            raise ValueError(
                f"attention_backend must be one of diffusers' backends {names}, got {self.attention_backend!r}"
            )


def compile_regions(
    model: torch.nn.Module, backend: str | None, mode: str | None, dynamic: bool | None = None
) -> None:
    """Compile ``model`` in place, region by region: each of its ``_repeated_blocks`` (diffusers' regional
    compilation), else each block of its longest child list of one class (SD3's joint blocks, which diffusers does not
    declare), else each of its children. The root's own hooks (the FLOP counter's) thus stay out of compiled code.
    ``dynamic``: ``torch.compile``'s."""
    options = {"backend": backend or "inductor", "mode": mode, "dynamic": dynamic}
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(**options)
        return
    blocks = block_list(model)
    if len(blocks) < 2:
        blocks = [
            b for child in model.children() for b in (child if isinstance(child, torch.nn.ModuleList) else [child])
        ]
    for block in blocks:
        block.compile(**options)


def block_list(model: torch.nn.Module) -> torch.nn.ModuleList | list:
    """The longest child list of ``model`` whose blocks are of one class (FLUX's single-stream blocks, SD3's joint
    blocks, Wan's blocks); ``[]`` if none."""
    lists = [m for m in model.children() if isinstance(m, torch.nn.ModuleList) and len({type(b) for b in m}) == 1]
    return max(lists, key=len, default=[])


def uses_dispatcher(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention processors call diffusers' attention dispatcher (so a backend can be set)."""
    processors = {type(m.processor) for m in model.modules() if getattr(m, "processor", None) is not None}
    return any(hasattr(processor, "_attention_backend") for processor in processors)


def resolve_attention_backend(
    requested: str | None, model: torch.nn.Module, device: torch.device, masks_text: bool
) -> str | None:
    """The backend ``"auto"`` stands for on ``device`` (see :class:`SpeedArguments`); other values as given."""
    if requested != "auto":
        return requested
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    if hopper and torch.backends.cudnn.is_available() and not masks_text and uses_dispatcher(model):
        return "_native_cudnn"
    return None


def resolve_torch_compile(requested: bool | None, device: torch.device, parameter_sharding: str | None) -> bool:
    """What ``torch_compile=None`` (the default) stands for: on for a CUDA device whose parameters are not sharded
    (FLUX.1-dev 1024² GRPO on an H200: rollouts 1.37x and training 1.07x faster, 31.9 → 36.3 % MFU)."""
    if requested is not None:
        return requested
    return device.type == "cuda" and parameter_sharding is None


def set_model_attention_backend(model: torch.nn.Module, backend: str) -> None:
    """``model.set_attention_backend(backend)`` for this model alone: diffusers also makes it the process-wide active
    backend, which every other dispatcher model (a reward's, an evaluation pipeline's) would then run; each of this
    model's processors carries its own, so the previous active backend is put back."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active, _ = _AttentionBackendRegistry.get_active_backend()
    model.set_attention_backend(backend)
    _AttentionBackendRegistry.set_active_backend(active)


def apply_speed_options(
    models: list[torch.nn.Module],
    args,
    device: torch.device,
    masks_text: bool = False,
    compile_models: bool = False,
    likelihood_ratio: str | None = None,
) -> None:
    """Set ``args.attention_backend`` (resolved for ``device``; ``masks_text``: the policy's) on each model and, with
    ``compile_models``, compile it regionally. With ``likelihood_ratio`` (the trainer's name, for a trainer whose loss
    is a likelihood ratio against its rollouts), refuse a model with a diffusers cache enabled."""
    torch.backends.cuda.enable_cudnn_sdp(args.cudnn_attention)
    for model in models:
        name = type(model).__name__
        if likelihood_ratio and getattr(model, "is_cache_enabled", False):
            raise ValueError(LOSSY_CACHE.format(name=name, model="transformer", trainer=likelihood_ratio))
        backend = resolve_attention_backend(args.attention_backend, model, device, masks_text)
        if backend is not None:
            if not uses_dispatcher(model):
                processors = {type(m.processor) for m in model.modules() if getattr(m, "processor", None) is not None}
                raise ValueError(
                    f"attention_backend={backend!r}: {name}'s attention processors "
                    f"({', '.join(sorted(p.__name__ for p in processors))}) call PyTorch's SDPA directly, not diffusers' "
                    "attention dispatcher, so no backend can be set; leave attention_backend unset"
                )
            set_model_attention_backend(model, backend)
        if compile_models:
            # rollout_backprop recomputes (activation checkpointing) a rollout's calls after calls with other numbers
            # of trained rows: a static graph per row count would let a recomputation run another graph than its
            # forward did (torch.utils.checkpoint's CheckpointError); one graph dynamic in its sizes serves both.
            dynamic = True if getattr(args, "rollout_backprop", False) else None
            compile_regions(model, args.torch_compile_backend, args.torch_compile_mode, dynamic)
