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
    families without repeated blocks compile the whole denoiser in place).

    Parameters:
        attention_backend (`str` or `None`, defaults to `None`): diffusers' attention backend for the denoiser
            (`model.set_attention_backend`): `"native"` (PyTorch SDPA), `"flash"`, `"_flash_3_hub"`, `"sage"`,
            `"_native_math"`, ... (`diffusers.models.attention_dispatch.AttentionBackendName`); None keeps the
            model's default. Rollouts and training run the same backend, so the first update of a round stays
            on-policy.
        cudnn_attention (`bool`, defaults to `False`): let PyTorch's SDPA pick its cuDNN kernel. Off by default,
            for the whole process: on an H200 (torch 2.11, cuDNN 9.19) its backward made an illegal memory access
            on FLUX.1-dev (head dimension 128, 1,536 tokens) while the flash kernel trained the same step;
            SD3.5 (head dimension 64) ran either way.
    """

    attention_backend: str | None = field(
        default=None, metadata={"help": "diffusers attention backend of the denoiser (native, flash, sage, ...)."}
    )

    cudnn_attention: bool = field(
        default=False, metadata={"help": "let PyTorch's SDPA use its cuDNN kernel (off: it crashed FLUX's backward)."}
    )

    def _check_speed(self) -> None:
        if self.attention_backend is None:
            return
        from diffusers.models.attention_dispatch import AttentionBackendName

        names = [backend.value for backend in AttentionBackendName]
        if self.attention_backend not in names:
            raise ValueError(
                f"attention_backend must be one of diffusers' backends {names}, got {self.attention_backend!r}"
            )


def compile_regions(model: torch.nn.Module, backend: str | None, mode: str | None) -> None:
    """Compile ``model`` in place: its ``_repeated_blocks`` each (regional compilation), else its whole forward."""
    options = {"backend": backend or "inductor", "mode": mode}
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(**options)
    else:
        model.compile(**options)


def apply_speed_options(models: list[torch.nn.Module], args, likelihood_ratio: str | None = None) -> None:
    """Set ``args.attention_backend`` on each model and, with ``args.torch_compile``, compile it regionally. With
    ``likelihood_ratio`` (the trainer's name, for a trainer whose loss is a likelihood ratio against its rollouts),
    refuse a model with a diffusers cache enabled."""
    torch.backends.cuda.enable_cudnn_sdp(args.cudnn_attention)
    for model in models:
        name = type(model).__name__
        if likelihood_ratio and getattr(model, "is_cache_enabled", False):
            raise ValueError(LOSSY_CACHE.format(name=name, model="transformer", trainer=likelihood_ratio))
        if args.attention_backend is not None:
            processors = {type(m.processor) for m in model.modules() if getattr(m, "processor", None) is not None}
            if not any(hasattr(processor, "_attention_backend") for processor in processors):
                raise ValueError(
                    f"attention_backend={args.attention_backend!r}: {name}'s attention processors "
                    f"({', '.join(sorted(p.__name__ for p in processors))}) call PyTorch's SDPA directly, not diffusers' "
                    "attention dispatcher, so no backend can be set; leave attention_backend unset"
                )
            model.set_attention_backend(args.attention_backend)
        if args.torch_compile:
            compile_regions(model, args.torch_compile_backend, args.torch_compile_mode)
