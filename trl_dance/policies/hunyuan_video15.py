"""HunyuanVideo 1.5 (8.3B rectified-flow video DiT on a Qwen2.5-VL text model and a ByT5 glyph encoder, 16×-compressing
VAE): text-to-video with CFG through the pipeline's guider."""

from __future__ import annotations

import torch
from diffusers import HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.utils import logging

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy, SamplerSettings
from .hunyuan_video import unshifted_sigmas
from .layout import VideoLatents

logger = logging.get_logger(__name__)


class _OneVideoAtATime(VideoLatents):
    """HunyuanVideo 1.5's VAE encodes and decodes one video at a time (its mid-block attention breaks on batches of
    several in diffusers 0.42.1; the pipeline samples one)."""

    def encode(self, images: torch.Tensor, generator=None, device=None) -> torch.Tensor:
        generators = generator if isinstance(generator, list) else [generator] * len(images)
        encode = super().encode
        return torch.cat([encode(video[None], g, device) for video, g in zip(images, generators)])

    def decode(self, latents: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        decode = super().decode
        return torch.cat([decode(video[None], clamp) for video in latents])


class HunyuanVideo15Policy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.HunyuanVideo15Pipeline` (HunyuanVideo 1.5 T2V, 480p / 720p; MeanFlow
    step-distilled checkpoints, ``use_meanflow``, embed the next step's time as their end time r). Latents are
    (B, C, F', H/16, W/16) with F' = (F − 1)/4 + 1; the transformer reads them with zero condition latents and a zero
    mask channel concatenated (the image-to-video inputs, empty for text-to-video), as the pipeline does.

    CFG is what the pipeline's ``guider`` does, a :class:`~diffusers.guiders.ClassifierFreeGuidance`: both branches,
    ``u + w (c − u)`` against the empty prompt or ``negative_prompt``, at ``guidance_scale`` (the pipeline reads its
    scale from the guider's config instead, 6.0 as shipped: keep the two equal to sample as the pipeline does). Guiders
    this policy does not reproduce (other classes, ``guidance_rescale``, a step window) are refused.

    Text: the Qwen2.5-VL hidden states three layers from the top after the pipeline's 108-token system-prompt crop,
    and ByT5 embeddings of quoted text (zeros and an empty mask when a prompt has none), each trimmed to a batch's
    longest (:attr:`~DiffusionPolicy.padded_text`; the pipeline pads to 1000 and 256 tokens; the transformer moves
    padding behind the valid tokens and masks it, so its length changes nothing). The pipeline's 729 image-embedding
    slots, all masked in text-to-video, are left out of the sequence too (the same outputs, less work). The VAE decodes
    one video at a time, and so does its encoder: its mid-block attention breaks on batches of several in diffusers 0.42.1. No
    context-parallel plan ships for this transformer.
    """

    pipeline: HunyuanVideo15Pipeline
    layout_class = _OneVideoAtATime
    masks_text = True
    padded_text = {"prompt_embeds": "prompt_embeds_mask", "prompt_embeds_2": "prompt_embeds_mask_2"}
    default_num_frames = 121
    flop_layout = FlopLayout(
        streams=(
            (r"time_embed|time_text_embed|norm1\w*\.linear|norm_out\.linear", SAMPLE),
            (r"^context_embedder\.", "mllm"),
            (r"^context_embedder_2\.", "byt5"),
            (r"^image_embedder\.", "vision"),
            (r"add_[qkv]_proj|to_add_out|ff_context", "text"),
        ),
        attention=((r"token_refiner", "mllm", "mllm"), (r"transformer_blocks", "image+text", "image+text")),
    )

    def __init__(self, pipeline: HunyuanVideo15Pipeline, settings: SamplerSettings):
        super().__init__(pipeline, settings)
        guider = pipeline.guider
        config = guider.config if isinstance(guider, ClassifierFreeGuidance) else None
        if config is None or config.guidance_rescale or (config.start, config.stop) != (0.0, 1.0):
            raise ValueError(
                "HunyuanVideo15Policy reproduces a ClassifierFreeGuidance guider without guidance_rescale over all "
                f"steps; this pipeline's guider is {guider!r}"
            )
        # MeanFlow (step-distilled) checkpoints are flow maps u(x_t, r, t): each call also embeds an end time r.
        self.flow_map = bool(pipeline.transformer.config.get("use_meanflow", False))
        shipped = config.guidance_scale if config.enabled else 1.0
        if max(shipped, 1.0) != max(settings.guidance_scale, 1.0):
            logger.warning(
                f"training with guidance_scale {settings.guidance_scale}; the pipeline samples with its guider's "
                f"{shipped}"
            )

    pipeline_tag = "text-to-video"

    def predict(self, model, latents, cond, *, at, guidance_scale=None) -> torch.Tensor:
        """:meth:`DiffusionPolicy.predict`; a MeanFlow checkpoint also takes its end time r, by default
        :meth:`_jump_end`'s, or (B,) σ given as ``cond["flow_map_end"]`` (MeanFlowNFT's (t, r) pairs)."""
        if self.flow_map:
            end = cond.get("flow_map_end")
            r = self._jump_end(at, latents) if end is None else self.process.timestep_at(end.to(latents.device))
            cond = {key: value for key, value in cond.items() if key != "flow_map_end"} | {"timestep_r": r}
        return super().predict(model, latents, cond, at=at, guidance_scale=guidance_scale)

    def _jump_end(self, at, latents: torch.Tensor) -> torch.Tensor:
        """A MeanFlow checkpoint's end time r (model units, (B,)): at a step, the next step's (0 after the last), so
        that the Euler step x_{t'} = x_t + (t' − t)·u(x_t, t', t) is the flow map's jump, as the image-to-video
        pipeline samples; at a time (forward-process losses, which read x̂0 = x_t − t·v), t itself: u(x_t, t, t) is
        the instantaneous velocity (MeanFlowNFT's pure-diffusion pairs)."""
        if not isinstance(at, torch.Tensor):
            dtype = torch.long if isinstance(at, int) else torch.float32
            at = torch.full((latents.shape[0],), at, device=latents.device, dtype=dtype)
        return self.process.timestep_at(at) if at.is_floating_point() else self.process.model_timestep(at + 1)

    def _scheduler_kwargs(self) -> dict:
        return unshifted_sigmas(self.settings.num_inference_steps)

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        pipeline = self.pipeline
        embeds, mask = pipeline._get_mllm_prompt_embeds(
            text_encoder=pipeline.text_encoder,
            tokenizer=pipeline.tokenizer,
            prompt=prompts,
            device=self.device,
            tokenizer_max_length=self.settings.max_sequence_length,
            system_message=pipeline.system_message,
            crop_start=pipeline.prompt_template_encode_start_idx,
        )
        glyphs, glyph_mask = pipeline._get_byt5_prompt_embeds(
            tokenizer=pipeline.tokenizer_2,
            text_encoder=pipeline.text_encoder_2,
            prompt=prompts,
            device=self.device,
            tokenizer_max_length=pipeline.tokenizer_2_max_length,
        )
        return {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "prompt_embeds_2": glyphs,
            "prompt_embeds_mask_2": glyph_mask,
        }

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        settings = self.settings
        return self.pipeline.prepare_latents(
            len(generators),
            self.pipeline.num_channels_latents,
            settings.height,
            settings.width,
            settings.num_frames,
            torch.float32,
            self.device,
            generators,
        )

    def _condition(self, latents: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C + 1, F', h, w) condition latents and mask channels, and (B, T, D) image embeddings: none here."""
        batch, channels, frames, height, width = latents.shape
        embeds = latents.new_zeros(batch, 0, self.denoiser.config.image_embed_dim)
        return latents.new_zeros(batch, channels + 1, frames, height, width), embeds

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype = self.denoiser.dtype
        condition, image_embeds = self._condition(latents, cond)
        end = cond.get("timestep_r")
        return model(
            hidden_states=torch.cat([latents, condition], dim=1).to(dtype),
            timestep=timestep.to(dtype),
            timestep_r=None if end is None else end.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_attention_mask=cond["prompt_embeds_mask"],
            encoder_hidden_states_2=cond["prompt_embeds_2"].to(dtype),
            encoder_attention_mask_2=cond["prompt_embeds_mask_2"],
            image_embeds=image_embeds.to(dtype),
            return_dict=False,
        )[0]

    def flop_tokens(self, inputs: dict[str, object]) -> dict[str, int]:
        hidden = inputs["hidden_states"]
        patch, patch_t = self.denoiser.config.patch_size, self.denoiser.config.patch_size_t
        frames, height, width = hidden.shape[2] // patch_t, hidden.shape[3] // patch, hidden.shape[4] // patch
        mllm, byt5 = inputs["encoder_hidden_states"].shape[1], inputs["encoder_hidden_states_2"].shape[1]
        vision = inputs["image_embeds"].shape[1]
        return {
            "image": frames * height * width,
            "mllm": mllm,
            "byt5": byt5,
            "vision": vision,
            "text": mllm + byt5 + vision,
            SAMPLE: 1,
        }


class HunyuanVideo15ImageToVideoPolicy(HunyuanVideo15Policy):
    """Policy over a :class:`~diffusers.HunyuanVideo15ImageToVideoPipeline` (HunyuanVideo 1.5 I2V): each prompt comes
    with the image its videos start from (dataset column ``image``). As in the pipeline, the image, resized and
    center-cropped to ``height`` × ``width``, enters as VAE latents in the first latent frame of the condition channels
    (zeros after it) with a mask channel 1 there, and as SigLIP embeddings in the transformer's sequence; both are
    shared by the CFG branches, which differ in the prompt only. The pipeline instead picks the output size from the
    image's aspect ratio and the transformer's ``target_size`` bucket: train at that size to sample as it does.
    """

    condition_columns = ("image",)
    pipeline_tag = "image-to-video"

    def _encode_columns(self, image: list) -> Conditioning:
        pipeline, settings, device = self.pipeline, self.settings, self.device
        latents, embeds = [], []
        for picture in image:
            sized = pipeline.video_processor.resize(
                picture, height=settings.height, width=settings.width, resize_mode="crop"
            )
            latents.append(
                pipeline._get_image_latents(
                    pipeline.vae, pipeline.video_processor, sized, settings.height, settings.width, device
                ).float()
            )
            embeds.append(
                pipeline._get_image_embeds(pipeline.image_encoder, pipeline.feature_extractor, sized, device).float()
            )
        return {"image_latents": torch.cat(latents), "image_embeds": torch.cat(embeds)}

    def _condition(self, latents: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        batch, _, frames, height, width = latents.shape
        first = cond["image_latents"].to(latents.dtype)  # (B, C, 1, h, w)
        rest = latents.new_zeros(batch, first.shape[1], frames - 1, height, width)
        mask = torch.cat(
            [latents.new_ones(batch, 1, 1, height, width), latents.new_zeros(batch, 1, frames - 1, height, width)],
            dim=2,
        )
        return torch.cat([torch.cat([first, rest], dim=2), mask], dim=1), cond["image_embeds"]
