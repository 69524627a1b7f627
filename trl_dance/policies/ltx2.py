"""LTX-2 (Lightricks' audio-video rectified-flow transformer on a Gemma 3 text encoder): one transformer denoises a
video's latent tokens and its soundtrack's latent tokens together, with LTX-2's multi-term guidance."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import PIL.Image
import torch
from diffusers import LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg
from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition
from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import resolve_default_image_crf, retrieve_latents
from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, conditioning_frame_rate
from diffusers.utils import is_av_available, logging
from diffusers.utils.torch_utils import randn_tensor

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy, SamplerSettings, step_after_given
from .layout import VideoLatents

logger = logging.get_logger(__name__)

LTX2_GUIDANCE = {
    "frame_rate": 24.0,
    "motion_speed": 1.0,
    "stg_scale": 1.0,
    "modality_scale": 3.0,
    "guidance_rescale": 0.7,
    "audio_guidance_scale": 7.0,
    "audio_stg_scale": 1.0,
    "audio_modality_scale": 3.0,
    "audio_guidance_rescale": 0.7,
    "spatio_temporal_guidance_blocks": [28],
    "use_cross_timestep": True,
}
"""``LTX2Pipeline.__call__``'s defaults for what :class:`LTX2Policy` reproduces besides ``guidance_scale``; override
them with the config's ``pipeline_kwargs`` under the same names."""


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Token layout of one sample: video (F', h, w) latent grid of ``video_channels`` and ``audio_frames`` audio latent
    frames of ``audio_channels`` (latent channels × latent mel bins) packed features."""

    frames: int
    height: int
    width: int
    video_channels: int
    audio_frames: int
    audio_channels: int
    # Latent frames of keyframe conditions appended as tokens (LTX2ConditionPipeline); a row holds them first.
    keyframes: int = 0

    @property
    def video_size(self) -> int:
        return (self.keyframes + self.frames) * self.height * self.width * self.video_channels


def guidance_options(settings: SamplerSettings) -> dict:
    """:data:`LTX2_GUIDANCE` with ``settings.pipeline_kwargs``; the audio terms left unset take the video's, as in the
    pipeline."""
    options = {**LTX2_GUIDANCE, **(settings.pipeline_kwargs or {})}
    for name in ("audio_stg_scale", "audio_modality_scale", "audio_guidance_rescale"):
        options[name] = options[name] or options[name[len("audio_") :]]
    return options


class AudioVideoLatents(VideoLatents):
    """LTX-2's latents: one row (B, D) per sample, the packed video tokens (F'·h·w, C) then the packed audio tokens
    (L, C_a·M), in the :class:`_Geometry` of the settings' size, frame count and frame rate."""

    def __init__(self, pipeline: LTX2Pipeline, settings: SamplerSettings):
        super().__init__(pipeline, settings)
        transformer, audio_config = pipeline.transformer, pipeline.audio_vae.config
        frame_rate = guidance_options(settings)["frame_rate"]
        self.geometry = _Geometry(
            frames=(settings.num_frames - 1) // pipeline.vae_temporal_compression_ratio + 1,
            height=settings.height // pipeline.vae_spatial_compression_ratio,
            width=settings.width // pipeline.vae_spatial_compression_ratio,
            video_channels=transformer.config.in_channels,
            audio_frames=round(  # (in the pipeline's order of operations: the rounding must agree)
                settings.num_frames
                / frame_rate
                * (
                    pipeline.audio_sampling_rate
                    / pipeline.audio_hop_length
                    / float(pipeline.audio_vae_temporal_compression_ratio)
                )
            ),
            audio_channels=audio_config.latent_channels
            * (audio_config.mel_bins // pipeline.audio_vae_mel_compression_ratio),
        )
        self._decode_timestep = torch.zeros(1) if pipeline.vae.config.timestep_conditioning else None

    def size_multiple(self) -> int:
        return self.pipeline.vae_spatial_compression_ratio * self.pipeline.transformer.config.patch_size

    @property
    def streams(self) -> dict[str, int]:
        """The video's then the audio's element counts in a row (rewards are routed to them by modality)."""
        g = self.geometry
        return {"video": g.video_size, "audio": g.audio_frames * g.audio_channels}

    def split(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, D) latents to the packed video (B, F'·h·w, C) and audio (B, L, C_a·M) tokens the transformer reads
        (with keyframes, the video's first K·h·w tokens are theirs)."""
        g = self.geometry
        video, audio = latents[:, : g.video_size], latents[:, g.video_size :]
        batch = len(latents)
        return video.reshape(batch, -1, g.video_channels), audio.reshape(batch, g.audio_frames, g.audio_channels)

    @staticmethod
    def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split`."""
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def encode(self, images: torch.Tensor, generator=None, device=None) -> torch.Tensor:
        raise NotImplementedError(
            "LTX-2 denoises a video and its soundtrack together: encoding real videos (Diffusion-DPO pairs) would need "
            "their audio latents too, which trl-dance does not encode yet"
        )

    def decode(self, latents: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """The videos (B, F, 3, H, W) float32 in [0, 1] of final latents (B, D), decoded as the pipeline decodes them
        (at ``decode_timestep`` 0 for a timestep-conditioned VAE)."""
        pipeline, g = self.pipeline, self.geometry
        vae = pipeline.vae
        tokens = self.split(latents)[0][:, g.keyframes * g.height * g.width :]  # (without appended keyframes)
        video = pipeline._unpack_latents(tokens, g.frames, g.height, g.width)
        video = pipeline._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        timestep = None if self._decode_timestep is None else self._decode_timestep.to(video.device).expand(len(video))
        decoded = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]
        return self.postprocess(decoded).float()

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """The soundtracks (B, channels, samples) float32 of final latents (B, D), at the vocoder's
        ``output_sampling_rate``: the audio VAE's mel spectrogram through the vocoder, as the pipeline decodes it."""
        pipeline, g = self.pipeline, self.geometry
        audio_vae = pipeline.audio_vae
        audio = pipeline._denormalize_audio_latents(
            self.split(latents)[1], audio_vae.latents_mean, audio_vae.latents_std
        )
        mel_bins = audio_vae.config.mel_bins // pipeline.audio_vae_mel_compression_ratio
        audio = pipeline._unpack_audio_latents(audio, g.audio_frames, num_mel_bins=mel_bins)
        spectrogram = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        return pipeline.vocoder(spectrogram.to(pipeline.vocoder.dtype)).float()


class LTX2Policy(DiffusionPolicy):
    """Policy over an :class:`~diffusers.LTX2Pipeline` (LTX-2 / LTX-2.3 text-to-audio-video).

    Latents: one (B, D) float32 row per sample, the video's packed tokens (F'·h·w, C) flattened, then its audio's
    packed tokens (L, C_a·M) flattened; both modalities are noised, stepped (one σ, one SDE) and scored as one vector,
    and :meth:`decode` returns the video (rewards score frames; :meth:`decode_audio` the waveform, for rewards that
    accept audio). The audio lasts ``num_frames / frame_rate`` seconds, as in the pipeline.

    Guidance is the pipeline's, in x0 space: CFG (``guidance_scale`` for the video, ``audio_guidance_scale`` for the
    audio; both branches in one batched forward, the empty prompt or ``negative_prompt`` unconditional), spatio-temporal
    guidance (a forward with the self-attention of ``spatio_temporal_guidance_blocks`` bypassed; skipped where it
    cannot change the output: transformers without ``perturbed_attn``, as LTX-2.0's, or no such block), modality
    isolation (a forward without the audio↔video cross-attention) and ``guidance_rescale`` per modality, with
    :data:`LTX2_GUIDANCE` (the pipeline's defaults) overridable through ``pipeline_kwargs``. At the defaults a step
    costs four forwards of the batch; ``stg_scale=0, audio_stg_scale=0, modality_scale=1, audio_modality_scale=1``
    leave CFG's two. Every term is differentiated in training.

    Text: Gemma 3's every hidden state through the pipeline's connectors (frozen, run once per prompt), prompts
    padded to ``max_sequence_length`` as the pipeline pads them (its default is 1024; the learnable registers of the
    connectors fill the padding, so the length changes the embeddings: sample at the length you will infer at).
    Prompt enhancement and the duration head (LTX-2.5) are not used: ``num_frames`` is fixed. Diffusion-DPO's
    encoding of real videos is refused (pairs would need their soundtracks).
    """

    pipeline: LTX2Pipeline
    layout_class = AudioVideoLatents
    has_audio = True
    masks_text = True
    default_num_frames = 121
    pipeline_defaults = LTX2_GUIDANCE
    # Video tokens are "image"; the audio↔video attentions read their own streams, empty in modality-isolated calls
    # (which skip them), as are the STG blocks' self-attention queries, keys and cores in STG calls (see __init__).
    flop_layout = FlopLayout(
        streams=(
            (r"^time_embed", "video_time"),  # one row per sample, or per video token where its timestep is (I2V)
            (r"time_embed|prompt_adaln|^av_cross_attn_", SAMPLE),
            (r"caption_projection", "text"),
            (r"audio_to_video_attn\.to_[kv]$", "a2v_audio"),
            (r"audio_to_video_attn", "a2v_video"),
            (r"video_to_audio_attn\.to_[kv]$", "v2a_video"),
            (r"video_to_audio_attn", "v2a_audio"),
            (r"attn2\.to_[kv]$", "text"),
            (r"(^|\.)audio_", "audio"),
        ),
        attention=(
            (r"audio_to_video_attn", "a2v_video", "a2v_audio"),
            (r"video_to_audio_attn", "v2a_audio", "v2a_video"),
            (r"audio_attn1", "audio", "audio"),
            (r"audio_attn2", "audio", "text"),
            (r"attn1", "image", "image"),
            (r"attn2", "image", "text"),
        ),
    )

    def __init__(self, pipeline: LTX2Pipeline, settings: SamplerSettings):
        self.options = options = guidance_options(settings)
        transformer = pipeline.transformer
        if (transformer.config.patch_size, transformer.config.patch_size_t) != (1, 1):
            raise ValueError("LTX2Policy packs latents with patch size 1 (every LTX-2 checkpoint)")
        self.fps = conditioning_frame_rate(options["frame_rate"], options["motion_speed"])
        blocks = [b for b in options["spatio_temporal_guidance_blocks"] or [] if b < transformer.config.num_layers]
        # Without perturbed attention (LTX-2.0) or a perturbed block, the STG forward is the conditional one again.
        self._stg_blocks = blocks if transformer.config.get("perturbed_attn", False) else []
        if self._stg_blocks:
            perturbed = rf"transformer_blocks\.({'|'.join(map(str, self._stg_blocks))})\."
            layout = self.flop_layout
            self.flop_layout = dataclasses.replace(
                layout,
                streams=(
                    (perturbed + r"audio_attn1\.to_[qk]$", "stg_audio"),
                    (perturbed + r"attn1\.to_[qk]$", "stg_image"),
                    *layout.streams,
                ),
                attention=(
                    (perturbed + r"audio_attn1$", "stg_audio", "stg_audio"),
                    (perturbed + r"attn1$", "stg_image", "stg_image"),
                    *layout.attention,
                ),
            )
        self.audio_sample_rate = pipeline.vocoder.config.output_sampling_rate
        super().__init__(pipeline, settings)  # (its σ grid shifts with the geometry's token count)
        length, connectors = settings.max_sequence_length, pipeline.connectors.config
        registers = [n for n in (connectors.video_connector_num_learnable_registers,) if n]
        if registers and length % registers[0]:
            raise ValueError(
                f"max_sequence_length {length} must be a multiple of the {registers[0]} learnable registers that "
                "LTX-2's text connectors put in the padding"
            )
        shipped = inspect.signature(type(pipeline).__call__).parameters["max_sequence_length"].default
        if length != shipped:
            logger.warning(
                f"prompts are padded to max_sequence_length {length}, the pipeline's default is {shipped}: its "
                f"connectors fill the padding, so call it with max_sequence_length={length} to sample as trained"
            )

    @property
    def geometry(self) -> _Geometry:
        return self.layout.geometry

    @property
    def use_cfg(self) -> bool:
        return self.settings.guidance_scale > 1.0 or self._audio_scale(None) > 1.0

    def _audio_scale(self, guidance_scale: float | None) -> float:
        """The audio's CFG scale: its own unless unset (or 0), then the video's (``guidance_scale`` where given)."""
        video = self.settings.guidance_scale if guidance_scale is None else guidance_scale
        return self.options["audio_guidance_scale"] or video

    def _scheduler_kwargs(self) -> dict:
        steps, config = self.settings.num_inference_steps, self.pipeline.scheduler.config
        g = self.geometry
        mu = calculate_shift(
            (g.keyframes + g.frames) * g.height * g.width,  # (the condition pipeline counts appended keyframes)
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )
        return {"sigmas": np.linspace(1.0, 1 / steps, steps), "mu": mu}

    def _video_noise(self, generator: torch.Generator) -> torch.Tensor:
        """One sample's packed video noise (1, F'·h·w, C), as the pipeline's ``prepare_latents`` draws it."""
        settings, g = self.settings, self.geometry
        return self.pipeline.prepare_latents(
            1, g.video_channels, settings.height, settings.width, settings.num_frames, 0.0, torch.float32,
            self.device, generator,
        )  # fmt: skip

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Each sample's video noise then its audio noise from its generator, as the pipeline draws them."""
        pipeline, g = self.pipeline, self.geometry
        rows = []
        for generator in generators:
            video = self._video_noise(generator)
            audio = pipeline.prepare_audio_latents(
                1, pipeline.audio_vae.config.latent_channels, g.audio_frames, pipeline.audio_vae.config.mel_bins, 0.0,
                torch.float32, self.device, generator,
            )  # fmt: skip
            rows.append(self.layout.join(video, audio))
        return torch.cat(rows)

    # --- conditioning and guidance --------------------------------------------------------------------------------

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        pipeline = self.pipeline
        embeds, mask = pipeline._get_gemma_prompt_embeds(
            list(prompts), max_sequence_length=self.settings.max_sequence_length, device=self.device
        )
        video, audio, mask = pipeline.connectors(embeds, mask, padding_side=pipeline.tokenizer.padding_side)
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": mask}

    def _video_timestep(self, timestep: torch.Tensor) -> torch.Tensor:
        """The video tokens' timestep input for the batch's (B,) timesteps (the same for every token here)."""
        return timestep

    def _forward(self, model, latents, timestep, cond, stg: bool = False, isolate: bool = False) -> torch.Tensor:
        dtype, g = self.denoiser.dtype, self.geometry
        video, audio = self.layout.split(latents)
        coords, appended = None, g.keyframes * g.height * g.width
        if appended:  # keyframe tokens: first in a row, after the video's own in the transformer's sequence
            video = torch.cat([video[:, appended:], video[:, :appended]], dim=1)
            coords = self.denoiser.rope.prepare_video_coords(
                len(latents), g.frames, g.height, g.width, latents.device, fps=self.fps
            )
            coords = torch.cat([coords, cond["keyframe_coords"].to(coords)], dim=2)
        video_out, audio_out = model(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            audio_encoder_hidden_states=cond["audio_prompt_embeds"].to(dtype),
            timestep=self._video_timestep(timestep),
            audio_timestep=timestep,
            sigma=timestep,  # (LTX-2.3's prompt modulation reads it; the pipeline passes the timestep)
            encoder_attention_mask=cond["prompt_attention_mask"],
            audio_encoder_attention_mask=cond["prompt_attention_mask"],
            num_frames=g.frames,
            height=g.height,
            width=g.width,
            fps=self.fps,
            audio_num_frames=g.audio_frames,
            isolate_modalities=isolate,
            spatio_temporal_guidance_blocks=self._stg_blocks if stg else None,
            use_cross_timestep=self.options["use_cross_timestep"],
            video_coords=coords,
            return_dict=False,
        )
        if appended:
            video_out = torch.cat([video_out[:, -appended:], video_out[:, :-appended]], dim=1)
        return self.layout.join(video_out, audio_out)

    def flop_tokens(self, inputs: dict[str, object]) -> dict[str, int]:
        video, audio = inputs["hidden_states"].shape[1], inputs["audio_hidden_states"].shape[1]
        crossed = not inputs.get("isolate_modalities", False)
        attended = not inputs.get("spatio_temporal_guidance_blocks")
        tokens = {"image": video, "audio": audio, "text": inputs["encoder_hidden_states"].shape[1], SAMPLE: 1}
        tokens["video_time"] = inputs["timestep"][0].numel()
        tokens |= {"stg_image": video * attended, "stg_audio": audio * attended}
        tokens |= {"a2v_video": video * crossed, "v2a_video": video * crossed}
        return tokens | {"a2v_audio": audio * crossed, "v2a_audio": audio * crossed}

    def _guided(
        self,
        model: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float | None = None,
    ) -> torch.Tensor:
        """The guided velocity (B, D) float32, combined as the pipeline combines it: each forward's velocity to
        x̂0 = x − σ·v, then per modality ``x̂0_c + (w − 1)(x̂0_c − x̂0_u) + s (x̂0_c − x̂0_stg) + (m − 1)(x̂0_c − x̂0_iso)``,
        rescaled towards x̂0_c's std by ``guidance_rescale``, and back to a velocity (x − x̂0)/σ."""
        options, size = self.options, self.geometry.video_size
        scales = {
            "cfg": (
                self.settings.guidance_scale if guidance_scale is None else guidance_scale,
                self._audio_scale(guidance_scale),
            ),
            "stg": (options["stg_scale"], options["audio_stg_scale"]),
            "isolate": (options["modality_scale"], options["audio_modality_scale"]),
        }
        sigma = (timestep / self.pipeline.scheduler.config.num_train_timesteps).float().view(-1, 1)
        x = latents.float()

        def clean(velocity: torch.Tensor) -> torch.Tensor:
            return x - velocity * sigma

        if max(scales["cfg"]) > 1.0:
            uncond, text = self._call(model, *self._both_branches(latents, timestep, cond)).chunk(2)
            text = clean(text)
            guided = [(scales["cfg"], clean(uncond), -1.0)]
        else:
            text = clean(self._call(model, latents, timestep, cond))
            guided = []
        if max(scales["stg"]) > 0.0 and self._stg_blocks:
            guided.append((scales["stg"], clean(self._call(model, latents, timestep, cond, stg=True)), 0.0))
        if max(scales["isolate"]) > 1.0:
            guided.append((scales["isolate"], clean(self._call(model, latents, timestep, cond, isolate=True)), -1.0))
        parts = []
        for modality, (start, stop) in enumerate(((0, size), (size, x.shape[1]))):
            conditional = text[:, start:stop]
            result = conditional
            for term_scales, other, offset in guided:
                result = result + (term_scales[modality] + offset) * (conditional - other[:, start:stop])
            rescale = options["audio_guidance_rescale" if modality else "guidance_rescale"]
            parts.append(rescale_noise_cfg(result, conditional, rescale) if rescale > 0 else result)
        return (x - torch.cat(parts, dim=1)) / sigma

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        return self.layout.decode_audio(latents)


class LTX2ImageToVideoPolicy(LTX2Policy):
    """Policy over an :class:`~diffusers.LTX2ImageToVideoPipeline`: each sample starts from the image in the dataset
    column ``image`` (PIL), its first frame, with its soundtrack generated as in text-to-audio-video.

    As in the pipeline, the image is re-compressed as one H.264 frame at ``image_crf`` (``pipeline_kwargs``; default
    the pipeline's for its text encoder, 33 for LTX-2/2.3 on Gemma 3, which needs PyAV; 0 skips it), encoded by the VAE
    (its mode) and normalised; its latents take the first latent frame's tokens in every forward, at timestep 0 on
    those tokens. That frame is given, not sampled: the transitions, their log-probabilities and the video stream of
    routed rewards cover the other frames' tokens and the audio.
    """

    condition_columns = ("image",)
    pipeline_tag = "image-to-video"
    pipeline_defaults = {**LTX2_GUIDANCE, "image_crf": None}

    def __init__(self, pipeline: LTX2Pipeline, settings: SamplerSettings):
        super().__init__(pipeline, settings)
        crf = self.options.get("image_crf")
        self.image_crf = resolve_default_image_crf(pipeline.text_encoder) if crf is None else crf
        if self.image_crf and not is_av_available():
            raise ValueError(
                f"LTX-2 image-to-video re-compresses each image as one H.264 frame at CRF {self.image_crf} (the "
                "pipeline's default for its text encoder), which needs PyAV: `pip install av`, or skip it with "
                "pipeline_kwargs {image_crf: 0} (and sample with image_crf=0 afterwards)"
            )

    @property
    def _given(self) -> int:
        """Elements of a row given by the conditions: the first latent frame's (h·w packed video tokens), after any
        keyframe's tokens (LTX2ConditionPolicy), which a row holds first."""
        g = self.geometry
        return (g.keyframes + 1) * g.height * g.width * g.video_channels

    @property
    def streams(self) -> dict[str, int]:
        streams = dict(self.layout.streams)
        streams["video"] -= self._given  # (the given frame is not sampled)
        return streams

    @torch.no_grad()
    def _encode_columns(self, image: list) -> Conditioning:
        pipeline, settings, vae, crf = self.pipeline, self.settings, self.pipeline.vae, self.image_crf
        rows = []
        for picture in image:
            if crf:
                picture = PIL.Image.fromarray(apply_image_conditioning_crf(np.array(picture.convert("RGB")), crf))
            pixels = pipeline.video_processor.preprocess(picture, height=settings.height, width=settings.width)
            encoded = vae.encode(pixels.to(self.device, vae.dtype).unsqueeze(2))
            latent = retrieve_latents(encoded, None, "argmax").float()  # (1, C, 1, h, w)
            latent = pipeline._normalize_latents(latent, vae.latents_mean, vae.latents_std)
            rows.append(pipeline._pack_latents(latent, 1, 1).flatten(1))
        return {"image_latents": torch.cat(rows)}

    def _video_noise(self, generator: torch.Generator) -> torch.Tensor:
        # What the I2V pipeline's prepare_latents draws (the given frame's part is unused: the image's replaces it).
        g = self.geometry
        shape = (1, g.video_channels, g.frames, g.height, g.width)
        return self.pipeline._pack_latents(randn_tensor(shape, generator=generator, device=self.device), 1, 1)

    def _with_image(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Rows (B, D) with the given tokens (the first latent frame's, any keyframe's) replaced by the conditions'."""
        return torch.cat([cond["image_latents"].to(latents), latents[:, self._given :]], dim=1)

    def _guided(self, model, latents, timestep, cond, guidance_scale=None) -> torch.Tensor:
        # (Every term's x̂0, and so the rescale's std, sees the image's tokens, as in the pipeline.)
        return super()._guided(model, self._with_image(latents, cond), timestep, cond, guidance_scale)

    def _video_timestep(self, timestep: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        given = torch.zeros((g.frames + g.keyframes) * g.height * g.width, device=timestep.device)
        given[: g.height * g.width] = 1.0  # the first frame's tokens, and (in the transformer's order) any keyframe's
        given[g.frames * g.height * g.width :] = 1.0
        return timestep[:, None] * (1 - given)  # (B, tokens): 0 on the given tokens

    def step(self, model_output: torch.Tensor, latents: torch.Tensor, step_index: torch.Tensor, **options):
        # The given frame carries over unchanged (the image's replaces it in every input and at the end).
        return step_after_given(super().step, model_output, latents, step_index, self._given, 1, **options)

    def final_latents(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return self._with_image(latents, cond)


class LTX2ConditionPolicy(LTX2ImageToVideoPolicy):
    """Policy over an :class:`~diffusers.LTX2ConditionPipeline` with frame conditions of strength 1: the dataset's
    ``image`` is the first frame (a condition at latent index 0, its tokens replaced as in image-to-video) and, where
    the rows have a ``last_image`` column, that image is a keyframe at the last latent frame (index −1), appended to the
    video's tokens with its own positions, as the pipeline appends non-first-frame conditions.

    Both are encoded by the pipeline's own ``prepare_latents`` (its H.264 re-compression at ``image_crf``, resize and
    crop, VAE mode, normalisation, keyframe positions); their tokens are given, not sampled (timestep 0, held out of
    every step: with strength 1 the pipeline's x̂0 blend keeps them at the condition exactly). A row holds the keyframe's
    tokens first, then the video's own and the audio; the transformer reads them in the pipeline's order. The σ grid's
    shift counts the keyframe's tokens, as the pipeline's does. Conditions of strength below 1, video conditions and
    other frame indices are not supported. The pipeline draws a batch's noise from one generator: it matches the policy
    for one prompt at a time.
    """

    optional_condition_columns = ("last_image",)

    def use_condition_columns(self, columns: list[str]) -> None:
        super().use_condition_columns(columns)
        if "last_image" in self.condition_columns and not self.geometry.keyframes:
            self.layout.geometry = dataclasses.replace(self.geometry, keyframes=1)
            self.process = self.make_process()  # (the shift counts the keyframe's tokens)

    @torch.no_grad()
    def _encode_columns(self, image: list, last_image: list | None = None) -> Conditioning:
        """Each row's given tokens (B, given elements) in row order, and its keyframe positions (B, 3, K·h·w, 2)."""
        pipeline, settings, g = self.pipeline, self.settings, self.geometry
        first, rows, coords = g.height * g.width, [], []
        for index, picture in enumerate(image):
            conditions = [LTX2VideoCondition(frames=picture, index=0, crf=self.image_crf)]
            if last_image is not None:
                conditions.append(LTX2VideoCondition(frames=last_image[index], index=-1, crf=self.image_crf))
            _, mask, clean, keyframe_coords = pipeline.prepare_latents(
                conditions, 1, g.video_channels, settings.height, settings.width, settings.num_frames, self.fps,
                1.0, torch.float32, self.device, torch.Generator(self.device).manual_seed(0),
            )  # fmt: skip
            base = g.frames * first
            rows.append(torch.cat([clean[:, base:], clean[:, :first]], dim=1).flatten(1))
            if keyframe_coords is not None:
                coords.append(keyframe_coords)
            expected = torch.zeros_like(mask[0, :, 0])
            expected[:first], expected[base:] = 1, 1
            if not torch.equal(mask[0, :, 0], expected):  # (strength 1 everywhere the conditions are)
                raise ValueError("the conditions' tokens are not where LTX2ConditionPolicy expects them")
        return {"image_latents": torch.cat(rows)} | ({"keyframe_coords": torch.cat(coords)} if coords else {})

    def _video_noise(self, generator: torch.Generator) -> torch.Tensor:
        # The condition pipeline draws its packed (1, tokens + keyframe tokens, C) noise at once; a row holds the
        # keyframe's part first.
        g = self.geometry
        tokens, appended = g.frames * g.height * g.width, g.keyframes * g.height * g.width
        noise = randn_tensor((1, tokens + appended, g.video_channels), generator=generator, device=self.device)
        return torch.cat([noise[:, tokens:], noise[:, :tokens]], dim=1)
