"""Wan text-to-video and image-to-video (rectified flow, UMT5 text encoder, causal 3D VAE), CFG in sampling and
loss."""

from __future__ import annotations

import math

import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from diffusers.utils.torch_utils import randn_tensor

from ..flops import SAMPLE, FlopLayout
from .base import At, Conditioning, DiffusionPolicy, SamplerSettings, step_after_given
from .layout import VideoLatents


class WanPolicy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.WanPipeline`: Wan 2.1 T2V, Wan 2.2 TI2V-5B as T2V, and the two-expert Wan 2.2
    A14B.

    Latents are (B, C, F', H/s, W/s) with F' = (F − 1)/t + 1 for the VAE's temporal and spatial factors t, s (4 and 8
    for Wan 2.1); :meth:`decode` returns videos (B, F, 3, H, W) in [0, 1].

    Two experts (``transformer_2`` with ``boundary_ratio`` b): as in the pipeline, ``transformer`` serves the steps
    whose timestep is at least b · T_train (high noise, CFG scale ``guidance_scale``) and ``transformer_2`` the others
    (low noise, ``guidance_scale_2``, default the same). ``settings.train_expert`` picks the trained one; the other
    stays frozen, and only the trained expert's steps become transitions.
    """

    layout_class = VideoLatents
    default_num_frames = 81
    """Wan 2.1's published frame count (5 s at 16 fps), used when ``settings.num_frames`` is None."""
    flop_layout = FlopLayout(
        streams=(
            (r"condition_embedder\.time", SAMPLE),
            (r"condition_embedder\.text_embedder|attn2\.to_[kv]$", "text"),
            (r"image_embedder|add_[kv]_proj", "image_embeds"),  # I2V 14B: CLIP image tokens in the cross-attention
        ),
        attention=((r"attn1", "image", "image"), (r"attn2", "image", "text+image_embeds")),
    )

    def __init__(self, pipeline: WanPipeline, settings: SamplerSettings):
        if settings.train_expert not in ("high_noise", "low_noise"):
            raise ValueError(f"train_expert must be 'high_noise' or 'low_noise', got {settings.train_expert!r}")
        two_experts = pipeline.transformer_2 is not None
        if pipeline.transformer is None or two_experts != (pipeline.config.boundary_ratio is not None):
            raise ValueError(
                "a Wan pipeline needs a transformer, and a transformer_2 exactly when its config has a boundary_ratio"
            )
        if not two_experts and (settings.train_expert != "high_noise" or settings.guidance_scale_2 is not None):
            raise ValueError(
                "train_expert='low_noise' and guidance_scale_2 apply to two-expert Wan 2.2 pipelines (transformer_2); "
                "this one has a single transformer"
            )
        # An instance attribute: the trained expert is the pipeline component the trainer trains and saves.
        self.denoiser_name = "transformer_2" if settings.train_expert == "low_noise" else "transformer"
        settings = VideoLatents.checked_settings(pipeline, settings, self.default_num_frames)
        temporal = pipeline.vae_scale_factor_temporal
        # The transformer's rotary tables cover rope_max_seq_len patches per axis (1024 in Wan; less in small models).
        config = pipeline.transformer.config
        # Latent patches along (frames, height, width): the transformer's token grid.
        self._patches = patches = (
            ((settings.num_frames - 1) // temporal + 1) // config.patch_size[0],
            settings.height // pipeline.vae_scale_factor_spatial // config.patch_size[1],
            settings.width // pipeline.vae_scale_factor_spatial // config.patch_size[2],
        )
        for name, count in zip(("num_frames", "height", "width"), patches):
            if count > config.rope_max_seq_len:
                raise ValueError(
                    f"{name}={getattr(settings, name)} gives {count} latent patches along that axis, more than this "
                    f"transformer's rope_max_seq_len ({config.rope_max_seq_len}); use a smaller {name}"
                    + (f" (the default is {self.default_num_frames})" if name == "num_frames" else "")
                )
        super().__init__(pipeline, settings)
        # Which steps the trained expert serves, decided once on the CPU (the sampler must not read device values).
        steps = torch.arange(self.num_steps)
        if two_experts:
            boundary = pipeline.config.boundary_ratio * pipeline.scheduler.config.num_train_timesteps
            high_noise = self.process.model_timestep(steps) >= boundary
            self._trained_steps = (high_noise if self.denoiser_name == "transformer" else ~high_noise).tolist()
        else:
            self._trained_steps = [True] * self.num_steps
        if not self.trainable_steps():
            raise ValueError(
                f"the {settings.train_expert} expert serves none of the first {self.num_steps - 1} steps of this "
                f"schedule (boundary_ratio {pipeline.config.boundary_ratio}); train the other expert or change the "
                "schedule"
            )

    @property
    def lora_name(self) -> str:
        # diffusers saves and loads both experts' LoRAs under "transformer" (load_into_transformer_2 picks the second).
        return "transformer"

    def trained_denoiser_steps(self) -> list[int]:
        return [i for i in range(self.num_steps) if self._trained_steps[i]]

    @property
    def guidance_scale(self) -> float:
        return self._expert_guidance_scale(self.denoiser_name)

    def _expert_guidance_scale(self, name: str) -> float:
        second = self.settings.guidance_scale_2
        return second if name == "transformer_2" and second is not None else self.settings.guidance_scale

    @property
    def _frozen_expert_name(self) -> str | None:
        if self.pipeline.transformer_2 is None:
            return None
        return "transformer_2" if self.denoiser_name == "transformer" else "transformer"

    @property
    def frozen_expert(self) -> torch.nn.Module | None:
        frozen = self._frozen_expert_name
        return None if frozen is None else getattr(self.pipeline, frozen)

    def _serving(self, model: torch.nn.Module, at: At) -> tuple[torch.nn.Module, float | None]:
        # A host-side step or time picks the expert that serves it; per-sample tensors are the trained expert's.
        frozen = self._frozen_expert_name
        if frozen is None or isinstance(at, torch.Tensor):
            return model, None
        if isinstance(at, int):
            trained = self._trained_steps[at]
        else:  # off the grid the expert is picked as the pipeline picks it, by the timestep against the boundary
            train_steps = self.pipeline.scheduler.config.num_train_timesteps
            high_noise = at * train_steps >= self.pipeline.config.boundary_ratio * train_steps
            trained = ("transformer" if high_noise else "transformer_2") != frozen
        return (model, None) if trained else (self.frozen_expert, self._expert_guidance_scale(frozen))

    def context_parallel_lengths(self) -> dict[str, int]:
        # diffusers' Wan plan splits the video tokens only (the text is attended to whole, by cross-attention).
        return {"video tokens": math.prod(self._patches)}

    def context_parallel_hint(self) -> str:
        return "num_frames/height/width"

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        # The base class passes the empty prompt for the negative branch: plain encoding serves both.
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            device=self.device,
            max_sequence_length=self.settings.max_sequence_length,
        )
        return {"prompt_embeds": embeds}

    def _latent_shape(self, batch: int) -> tuple[int, ...]:
        pipeline, settings = self.pipeline, self.settings
        return (
            batch,
            pipeline.vae.config.z_dim,
            (settings.num_frames - 1) // pipeline.vae_scale_factor_temporal + 1,
            settings.height // pipeline.vae_scale_factor_spatial,
            settings.width // pipeline.vae_scale_factor_spatial,
        )

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        # What both Wan pipelines' prepare_latents draw (the image-to-video one also encodes its image there).
        return randn_tensor(self._latent_shape(len(generators)), generator=generators, device=self.device)

    def _model_input(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The denoiser's ``hidden_states`` for the policy's latents."""
        return latents

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        image_embeds = cond.get("image_embeds")
        if image_embeds is not None and self.denoiser.config.get("pos_embed_seq_len") is not None:
            # FLF2V's image embedder takes the two images as rows (2B, N, D) and pairs them itself.
            image_embeds = image_embeds.reshape(-1, image_embeds.shape[1] // 2, image_embeds.shape[2])
        if self.pipeline.config.expand_timesteps:
            timestep = timestep[:, None] * self._token_noise_mask(latents)[None]
        # The frozen expert may be held in another dtype (frozen_dtype) than the trained one.
        dtype = (model if model is self.frozen_expert else self.denoiser).dtype
        # The timestep stays float32, as in WanPipeline: the transformer casts it after the sinusoidal projection.
        return model(
            hidden_states=self._model_input(latents, cond).to(dtype),
            timestep=timestep.float(),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(dtype),
            return_dict=False,
        )[0]

    def _token_noise_mask(self, latents: torch.Tensor) -> torch.Tensor:
        """Wan 2.2 TI2V takes one timestep per latent token, the step's timestep times this (T,) mask of ones (T
        tokens in the transformer's order: frame, row, column of patches)."""
        patch_t, patch_h, patch_w = self.denoiser.config.patch_size
        frames, height, width = latents.shape[2:]
        return latents.new_ones(frames // patch_t * (height // patch_h) * (width // patch_w))


class WanImageToVideoPolicy(WanPolicy):
    """Policy over a :class:`~diffusers.WanImageToVideoPipeline`: each sample starts from the image in the dataset
    column ``image`` (PIL), which becomes its first frame.

    As in the pipeline, Wan 2.1 and Wan 2.2 A14B concatenate the image's VAE latents (the image followed by black
    frames) and a first-frame mask to the noisy latents on the channel axis, and Wan 2.1 also attends to its CLIP
    vision features (``image_dim``); both are shared by the CFG branches, which differ in the prompt only. Wan 2.2
    TI2V (``expand_timesteps``) instead puts the image's latent in place of the first latent frame, with timestep 0
    on its tokens: that frame is given, not sampled, so the transitions and their log-probabilities cover the other
    frames only.

    First-last-frame (Wan 2.1 FLF2V, whose image embedder has positions for two images' CLIP tokens): the dataset's
    ``last_image`` column is the video's last frame, as the pipeline's ``last_image``: its latents close the image
    condition, the frame mask marks both ends, and the cross-attention reads both images' features. Wan 2.2 A14B
    (no CLIP features) takes the last frame where the rows have a ``last_image`` column (latents and mask only).
    """

    condition_columns = ("image",)
    pipeline_tag = "image-to-video"

    def __init__(self, pipeline: WanImageToVideoPipeline, settings: SamplerSettings):
        super().__init__(pipeline, settings)
        self._last_frame_given = self.denoiser.config.get("pos_embed_seq_len") is not None
        if self._last_frame_given:
            self.condition_columns = ("image", "last_image")
        self._first_frame_given = bool(pipeline.config.expand_timesteps)
        if not (self._last_frame_given or self._first_frame_given or self.denoiser.config.image_dim is not None):
            # Wan 2.2 A14B image-to-video (no CLIP features): the pipeline's optional last frame, where rows have one.
            self.optional_condition_columns = ("last_image",)
        if self._first_frame_given and self.denoiser.config.patch_size[0] != 1:
            raise ValueError("Wan 2.2 TI2V image-to-video needs one latent frame per token (patch_size[0] == 1)")

    def step(self, model_output: torch.Tensor, latents: torch.Tensor, step_index: torch.Tensor, **options):
        if not self._first_frame_given:
            return super().step(model_output, latents, step_index, **options)
        # The first latent frame is replaced by the image's in every model input and in the output: it carries
        # over unchanged, and only the other frames are drawn and scored.
        return step_after_given(super().step, model_output, latents, step_index, 1, 2, **options)

    def final_latents(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return self._model_input(latents, cond) if self._first_frame_given else latents

    @torch.no_grad()
    def _encode_columns(self, image: list, last_image: list | None = None) -> Conditioning:
        pipeline, settings, device = self.pipeline, self.settings, self.device
        cond = {}
        if self.denoiser.config.image_dim is not None:
            # The pipeline's encode_image, with the pixels cast to the encoder's dtype (it may be frozen in bf16);
            # FLF2V: each sample's first and last images, their tokens side by side (B, 2·N, D).
            images = list(image) if last_image is None else [one for pair in zip(image, last_image) for one in pair]
            encoder = pipeline.image_encoder
            pixels = pipeline.image_processor(images=images, return_tensors="pt").pixel_values
            outputs = encoder(pixel_values=pixels.to(device, encoder.dtype), output_hidden_states=True)
            features = outputs.hidden_states[-2]
            cond["image_embeds"] = features.reshape(len(image), -1, features.shape[-1])

        def frames_of(images: list) -> torch.Tensor:
            frames = pipeline.video_processor.preprocess(images, height=settings.height, width=settings.width)
            return frames.to(device, torch.float32)

        frames = frames_of(list(image))
        last = None if last_image is None else frames_of(list(last_image))
        # One image at a time: prepare_latents repeats a single image's condition to its batch size. The given
        # (unused) latents keep it from drawing noise from the global generator.
        placeholder = torch.zeros(self._latent_shape(1), device=device)
        conditions = [
            pipeline.prepare_latents(
                frames[i : i + 1],
                1,
                pipeline.vae.config.z_dim,
                settings.height,
                settings.width,
                settings.num_frames,
                torch.float32,
                device,
                latents=placeholder,
                last_image=None if last is None else last[i : i + 1],
            )[1]
            for i in range(frames.shape[0])
        ]
        # (B, t + C, F', h, w): frame mask and image latents; TI2V: (B, C, 1, h, w) the first frame's latents.
        cond["image_condition"] = torch.cat(conditions)
        return cond

    def _model_input(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        if self._first_frame_given:
            return torch.cat([cond["image_condition"].to(latents.dtype), latents[:, :, 1:]], dim=2)
        return torch.cat([latents, cond["image_condition"].to(latents.dtype)], dim=1)

    def _token_noise_mask(self, latents: torch.Tensor) -> torch.Tensor:
        mask = super()._token_noise_mask(latents)
        if self._first_frame_given:
            # The given first frame's tokens are noise-free (timestep 0), as in the pipeline.
            _, patch_h, patch_w = self.denoiser.config.patch_size
            mask[: (latents.shape[3] // patch_h) * (latents.shape[4] // patch_w)] = 0
        return mask
