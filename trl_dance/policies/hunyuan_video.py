"""HunyuanVideo (rectified flow, dual/single-stream transformer with embedded guidance, Llama + CLIP text encoders,
causal 3D VAE): text-to-video, and text-to-image as one-frame videos (DanceGRPO's HunyuanVideo-T2I)."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy
from .layout import VideoLatents


def unshifted_sigmas(steps: int) -> dict:
    """``set_timesteps`` arguments of the HunyuanVideo pipelines: the unshifted grid linspace(1, 0, N + 1)[:-1] (the
    scheduler shifts it)."""
    return {"sigmas": np.linspace(1.0, 0.0, steps + 1)[:-1]}


class HunyuanVideoPolicy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.HunyuanVideoPipeline`. Latents are (B, C, F', H/8, W/8) with F' = (F − 1)/4 + 1;
    :meth:`decode` returns videos (B, F, 3, H, W) in [0, 1]. ``num_frames=1`` is DanceGRPO's text-to-image use of the
    model: a one-frame video, decoded to (B, 1, 3, H, W), which image rewards score as that frame.

    HunyuanVideo is guidance-distilled: ``guidance_scale`` feeds its guidance embedding (× 1000, as the pipeline) and
    sampling uses no CFG (the pipeline's optional ``true_cfg_scale`` is not used). The pipeline's own schedule is the
    unshifted grid linspace(1, 0, N + 1)[:-1], shifted by the scheduler (7 as published).
    """

    supports_cfg = False
    layout_class = VideoLatents
    masks_text = True
    padded_text = {"prompt_embeds": "prompt_attention_mask"}  # (the transformer masks the rest; text has no RoPE)
    default_num_frames = 129
    """The pipeline's default frame count (5 s at 24 fps), used when ``settings.num_frames`` is None."""
    flop_layout = FlopLayout(
        streams=(
            (r"time_text_embed|norm\w*\.linear", SAMPLE),
            (r"^single_transformer_blocks", "image+text"),
            (r"context_embedder|add_[qkv]_proj|to_add_out|ff_context", "text"),  # with the text's token refiner
        ),
        attention=((r"token_refiner", "text", "text"), (r"transformer_blocks", "image+text", "image+text")),
    )

    @property
    def pipeline_tag(self) -> str:
        return "text-to-image" if self.settings.num_frames == 1 else "text-to-video"

    def _scheduler_kwargs(self) -> dict:
        return unshifted_sigmas(self.settings.num_inference_steps)

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        embeds, pooled, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.settings.max_sequence_length
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "prompt_attention_mask": mask}

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        settings = self.settings
        return self.pipeline.prepare_latents(
            len(generators),
            self.denoiser.config.in_channels,
            settings.height,
            settings.width,
            settings.num_frames,
            torch.float32,
            self.device,
            generators,
        )

    @property
    def embedded_guidance(self) -> float:
        """The scale fed to the guidance embedding (× 1000 in the call): ``guidance_scale`` for the distilled model."""
        return self.settings.guidance_scale

    def _model_input(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The transformer's ``hidden_states`` for the policy's latents."""
        return latents

    # Context parallelism: diffusers ships no plan for HunyuanVideo; this one splits the video tokens after the patch
    # embedding, the text after the token refiner (which attends over the whole prompt first), the RoPE rows of the
    # video tokens, and gathers after proj_out; each block's key mask is rebuilt for the gathered sequence.

    def context_parallel_lengths(self) -> dict[str, int]:
        config, pipeline, settings = self.denoiser.config, self.pipeline, self.settings
        frames = ((settings.num_frames - 1) // pipeline.vae_scale_factor_temporal + 1) // config.patch_size_t
        spatial = pipeline.vae_scale_factor_spatial * config.patch_size
        video = frames * (settings.height // spatial) * (settings.width // spatial)
        return {"video tokens": video, "text tokens": settings.max_sequence_length}

    def context_parallel_hint(self) -> str:
        return "num_frames/height/width or max_sequence_length"

    def context_parallel_plan(self) -> dict:
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        def split(dim: int, dims: int):
            return ContextParallelInput(split_dim=dim, expected_dims=dims, split_output=True)

        return {
            "x_embedder": {0: split(1, 3)},
            "context_embedder": {0: split(1, 3)},
            "rope": {0: split(0, 2), 1: split(0, 2)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def prepare_context_parallel(self, model: torch.nn.Module, size: int) -> None:
        """Rebuild every block's key mask for the sequence attention sees: under Ulysses each rank's (video, text)
        slices are gathered rank after rank, so the mask is [1…1, text mask slice r] for r = 0…C − 1 (the transformer
        builds it from its local lengths, which would mask the wrong keys: 1e-2 off with no error)."""
        prompt_masks: list[torch.Tensor] = []

        def capture(module, args, kwargs):
            prompt_masks[:] = [kwargs["encoder_attention_mask"].bool()]  # (B, T) of the whole prompt

        def rebuild(module, args, kwargs):
            video, text = args[0].shape[1], args[1].shape[1]
            mask = prompt_masks[0]
            visible = torch.ones(mask.shape[0], video, dtype=torch.bool, device=mask.device)
            parts = [part for r in range(size) for part in (visible, mask[:, r * text : (r + 1) * text])]
            return (*args[:3], torch.cat(parts, dim=1)[:, None, None, :], *args[4:]), kwargs

        model.register_forward_pre_hook(capture, with_kwargs=True)
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.register_forward_pre_hook(rebuild, with_kwargs=True)

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype = self.denoiser.dtype
        guidance = torch.full((latents.shape[0],), self.embedded_guidance * 1000.0, device=latents.device)
        return model(
            hidden_states=self._model_input(latents, cond).to(dtype),
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_attention_mask=cond["prompt_attention_mask"],
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype),
            guidance=guidance.to(dtype),
            return_dict=False,
        )[0]


class HunyuanSkyreelsImageToVideoPolicy(HunyuanVideoPolicy):
    """Policy over a :class:`~diffusers.HunyuanSkyreelsImageToVideoPipeline` (SkyReels-V1 image-to-video): each sample
    starts from the image in the dataset column ``image``, whose latents (first latent frame, zeros after it) are
    concatenated to the noisy latents along channels, and it is trained with CFG through both branches:
    ``guidance_scale`` is the pipeline's ``true_cfg_scale`` (6 as published) against ``negative_prompt`` (unset: the
    empty prompt, which the pipeline needs spelled out), the guidance embedding gets the pipeline's 1.0.

    The image is encoded with the VAE's posterior mean; the pipeline samples the posterior with the call's generator
    (the same image then conditions every sample of a group identically here).
    """

    supports_cfg = True
    condition_columns = ("image",)
    pipeline_tag = "image-to-video"

    @property
    def embedded_guidance(self) -> float:
        return 1.0

    def _encode_columns(self, image: list) -> Conditioning:
        pipeline, settings = self.pipeline, self.settings
        frames = pipeline.video_processor.preprocess(list(image), height=settings.height, width=settings.width)
        vae = pipeline.vae
        first = vae.encode(frames.to(self.device, vae.dtype).unsqueeze(2)).latent_dist.mode()
        first = first.float() * pipeline.vae_scaling_factor  # (B, C, 1, h, w)
        latent_frames = (settings.num_frames - 1) // pipeline.vae_scale_factor_temporal + 1
        padding = first.new_zeros(first.shape[0], first.shape[1], latent_frames - 1, *first.shape[3:])
        return {"image_latents": torch.cat([first, padding], dim=2)}

    def _model_input(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return torch.cat([latents, cond["image_latents"].to(latents.dtype)], dim=1)

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        # The latents the pipeline draws after encoding its image: (B, C, F', h, w) standard normal.
        settings, pipeline = self.settings, self.pipeline
        shape = (
            len(generators),
            self.denoiser.config.in_channels // 2,
            (settings.num_frames - 1) // pipeline.vae_scale_factor_temporal + 1,
            settings.height // pipeline.vae_scale_factor_spatial,
            settings.width // pipeline.vae_scale_factor_spatial,
        )
        return randn_tensor(shape, generator=generators, device=self.device)
