"""MiniMax-H3 (joint audio+video rectified flow on a Qwen3-VL text encoder, guidance-distilled): one transformer call
denoises a packed sequence ``[text | audio rows | video rows]``, the video rows on a σ grid of shift 12 and the audio
rows on one of shift 3, with a data-ward velocity (x0 = x + σ·v)."""

from __future__ import annotations

import dataclasses

import torch
from diffusers import MiniMaxH3ModularPipeline
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    align_num_frames,
    audio_latent_num_frames,
    video_latent_num_frames,
)
from diffusers.utils.torch_utils import randn_tensor

from ..flops import SAMPLE, FlopLayout
from ..sde import dance_sigmas
from .base import Conditioning, DiffusionPolicy, SamplerSettings
from .layout import VideoLatents
from .process import StreamFlowProcess
from .qwen_image import padded_prompt


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """One sample's rows: ``frames`` latent frames of ``rows_per_frame`` video rows of ``video_channels`` (the
    transformer's patch), and ``audio_channels`` (stereo) × ``audio_latents`` audio rows of ``audio_features``."""

    frames: int
    height: int
    width: int
    latent_channels: int
    patch: tuple[int, int, int]
    audio_latents: int
    audio_channels: int
    audio_features: int

    @property
    def video_rows(self) -> int:
        return self.frames // self.patch[0] * (self.height // self.patch[1]) * (self.width // self.patch[2])

    @property
    def video_channels(self) -> int:
        return self.latent_channels * self.patch[0] * self.patch[1] * self.patch[2]

    @property
    def audio_rows(self) -> int:
        return self.audio_channels * self.audio_latents


class PackedAudioVideoLatents(VideoLatents):
    """MiniMax-H3's latents: one row (B, D) per sample, its video rows (patchified latents, frame-major then
    row-major, as the pipeline packs them) then its channel-major audio rows, flattened."""

    def __init__(self, pipeline: MiniMaxH3ModularPipeline, settings: SamplerSettings):
        super().__init__(pipeline, settings)
        chunk, kept = pipeline.vae_frames_per_chunk, pipeline.vae_latents_per_chunk
        ratio = pipeline.vae_spatial_compression_ratio
        self.geometry = _Geometry(
            frames=video_latent_num_frames(settings.num_frames, chunk, kept),
            height=settings.height // ratio,
            width=settings.width // ratio,
            latent_channels=pipeline.vae_latent_channels,
            patch=pipeline.patch_size,
            audio_latents=audio_latent_num_frames(settings.num_frames, pipeline.fps),
            audio_channels=pipeline.audio_channels,
            audio_features=pipeline.audio_latent_channels,
        )

    @classmethod
    def checked_settings(
        cls, pipeline: MiniMaxH3ModularPipeline, settings: SamplerSettings, default_num_frames: int | None
    ) -> SamplerSettings:
        if settings.num_frames is None:
            settings = dataclasses.replace(settings, num_frames=default_num_frames)
        frames, chunk, kept = settings.num_frames, pipeline.vae_frames_per_chunk, pipeline.vae_latents_per_chunk
        if frames < 1 or align_num_frames(frames, chunk, kept) != frames:
            raise ValueError(f"num_frames must be {chunk}·n + {kept} for MiniMax-H3's VAE, got {frames}")
        low, high = pipeline.min_duration * pipeline.fps, pipeline.max_duration * pipeline.fps
        if not low <= frames <= high:
            raise ValueError(
                f"MiniMax-H3 generates {pipeline.min_duration}–{pipeline.max_duration} s at {pipeline.fps} fps: "
                f"num_frames must be in [{low:g}, {high:g}], got {frames}"
            )
        return settings

    def size_multiple(self) -> int:
        return self.pipeline.canvas_multiple

    @property
    def streams(self) -> dict[str, int]:
        """The video's then the audio's element counts in a row (rewards are routed to them by modality)."""
        g = self.geometry
        return {"video": g.video_rows * g.video_channels, "audio": g.audio_rows * g.audio_features}

    def split(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, D) latents to the video rows (B, R_v, C_v) and audio rows (B, R_a, C_a) the transformer reads."""
        g, batch = self.geometry, len(latents)
        video, audio = latents.split(list(self.streams.values()), dim=1)
        return video.reshape(batch, g.video_rows, g.video_channels), audio.reshape(batch, g.audio_rows, -1)

    @staticmethod
    def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split`."""
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def video_latents(self, rows: torch.Tensor) -> torch.Tensor:
        """Video rows (B, R_v, C_v) to normalised latents (B, C, F', h, w) (the pipeline's after-denoise unpacking)."""
        g, (pt, ph, pw) = self.geometry, self.geometry.patch
        rows = rows.reshape(-1, g.frames // pt, g.height // ph, g.width // pw, g.latent_channels, pt, ph, pw)
        return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(-1, g.latent_channels, g.frames, g.height, g.width)

    def encode(self, images: torch.Tensor, generator=None, device=None) -> torch.Tensor:
        raise NotImplementedError(
            "MiniMax-H3 denoises a video and its soundtrack together: encoding real videos (Diffusion-DPO pairs) would "
            "need their audio latents too, which trl-dance does not encode yet"
        )

    def decode(self, latents: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """The videos (B, F, 3, H, W) float32 in [0, 1] of final latents (B, D), decoded one at a time as the pipeline
        decodes its one (per-channel statistics, then the VAE's ImageNet-normalised output mapped back)."""
        pipeline, vae = self.pipeline, self.pipeline.vae
        video = self.video_latents(self.split(latents)[0])
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=video.device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=video.device).view(shape)
        pixel_mean = torch.tensor(pipeline.pixel_mean, device=video.device).view(shape)
        pixel_std = torch.tensor(pipeline.pixel_std, device=video.device).view(shape)
        videos = []
        for sample in video:
            decoded = vae.decode((sample[None] * std + mean).to(vae.dtype), return_dict=False)[0]
            decoded = decoded.float() * pixel_std + pixel_mean
            videos.append(decoded.clamp(0, 1) if clamp else decoded)
        return torch.cat(videos).transpose(1, 2)  # (B, 3, F, H, W) → (B, F, 3, H, W)

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """The stereo soundtracks (B, 2, samples) float32 of final latents (B, D) at the audio VAE's rate: each
        channel's rows through the (mono) audio VAE, as the pipeline decodes them."""
        g, audio_vae = self.geometry, self.pipeline.audio_vae
        rows = self.split(latents)[1]
        mean = torch.tensor(audio_vae.config.latents_mean, device=rows.device).view(1, -1, 1)
        std = torch.tensor(audio_vae.config.latents_std, device=rows.device).view(1, -1, 1)
        tracks = []
        for sample in rows:
            channels = sample.reshape(g.audio_channels, g.audio_latents, g.audio_features).permute(0, 2, 1)
            audio = audio_vae.decode((channels * std + mean).to(audio_vae.dtype), return_dict=False)[0]
            tracks.append(audio.float().permute(1, 0, 2))  # (channels, 1, samples) → (1, channels, samples)
        return torch.cat(tracks)


class MiniMaxH3Policy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.MiniMaxH3ModularPipeline` (MiniMax-H3 text-to-audio-video, ``t2va``).

    Latents: one (B, D) float32 row per sample, its video rows then its audio rows (:class:`PackedAudioVideoLatents`);
    ``policy.streams`` names them, so rewards route per modality (``reward_modalities``). The two streams step down
    their own σ grids in one transition (:class:`~trl_dance.policies.process.StreamFlowProcess`): with
    ``sigma_schedule="pipeline"`` the pipeline's two schedulers' grids (video ``shift`` 12, audio 3; the pipeline's
    ``num_inference_steps`` is the grid's length, ``N + 1`` here for N steps), with ``"dance"`` both at ``shift``.
    The checkpoint is guidance-distilled: one forward a step, no CFG. The transformer's velocity points to the data;
    the policy returns its negative, diffusers' ``ε − x0``, so every step and loss reads it as any flow family's.

    A forward packs each sample as the pipeline packs its one request — ``[text | audio | video]`` rows, the layout
    and per-row timesteps built by the pipeline's own block helpers — and the transformer takes one layout per call,
    shared by its batch: a batch runs in groups of equal prompt length and equal step (the prompt's length moves every
    row's rotary position; the pipeline has no padding). Prompts: the verbatim text (no template) through Qwen3-VL,
    read at ``hidden_states[text_encoder_layer]`` (50), stored padded to ``max_sequence_length`` with their length.
    Conditioned workflows (``fl2va``, ``ref2va``) and forward-process methods (one σ per sample) are not supported.
    """

    pipeline: MiniMaxH3ModularPipeline
    layout_class = PackedAudioVideoLatents
    has_audio = True
    supports_cfg = False
    default_num_frames = 124  # 17·7 + 5: the pipeline's default, its shortest clip (5 s at 24 fps)
    pipeline_tag = "text-to-video"
    flop_layout = FlopLayout(
        streams=(
            (r"^time_embedder|adaln_proj|^norm_out\.linear", SAMPLE),  # once per distinct timestep of a call
            (r"^context_embedder|^token_refiner", "text"),
            (r"^proj_in", "video"),
            (r"^audio_proj_in", "audio"),
        ),
        attention=((r"token_refiner", "text", "text"), (r"transformer_blocks", "sequence", "sequence")),
        default="sequence",  # the blocks, norm_out and both heads read the whole packed sequence
    )

    def __init__(self, pipeline: MiniMaxH3ModularPipeline, settings: SamplerSettings):
        if settings.guidance_scale > 1.0:
            raise ValueError(
                "MiniMax-H3 is guidance-distilled (one forward a step, no unconditional branch): set guidance_scale "
                f"to 1, got {settings.guidance_scale}"
            )
        super().__init__(pipeline, settings)
        self.audio_sample_rate = pipeline.audio_sampling_rate
        self._layouts: dict[tuple[int, torch.device], dict[str, torch.Tensor]] = {}

    @property
    def geometry(self) -> _Geometry:
        return self.layout.geometry

    def make_process(self) -> StreamFlowProcess:
        steps, settings = self.settings.num_inference_steps, self.settings
        if settings.sigma_schedule == "dance":
            grids = {name: dance_sigmas(steps, settings.shift) for name in self.layout.streams}
        elif settings.sigma_schedule == "pipeline":
            grids = {}
            for name, scheduler in zip(self.layout.streams, (self.pipeline.scheduler, self.pipeline.audio_scheduler)):
                copy = type(scheduler).from_config(scheduler.config)  # (the pipeline's own stays as the user had it)
                copy.set_timesteps(steps + 1)
                grids[name] = copy.sigmas.to("cpu", torch.float32)
        else:
            raise ValueError(f"sigma_schedule must be 'dance' or 'pipeline', got {settings.sigma_schedule!r}")
        return StreamFlowProcess(grids, self.layout.streams, settings)

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        pipeline, length = self.pipeline, self.settings.max_sequence_length
        encoder = pipeline.text_encoder
        rows = []
        for prompt in prompts:
            tokens = pipeline.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not 0 < len(tokens) <= length:
                raise ValueError(
                    f"a prompt is {len(tokens)} tokens for MiniMax-H3, which needs 1 to max_sequence_length ({length})"
                )
            embeds = get_qwen3vl_prompt_embeds(
                encoder, pipeline.processor, tokens, {}, pipeline.text_encoder_layer, self.device, encoder.dtype
            )
            rows.append(padded_prompt(embeds, None, length) | {"prompt_length": torch.tensor([len(tokens)])})
        return {key: torch.cat([row[key] for row in rows]).to(self.device) for key in rows[0]}

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Each sample's video noise (as a latent tensor, then patchified) then its audio rows from its generator, in
        the pipeline's order."""
        g, device = self.geometry, self.device
        rows = []
        for generator in generators:
            video = randn_tensor(
                (1, g.latent_channels, g.frames, g.height, g.width), generator=generator, device=device,
                dtype=torch.float32,
            )  # fmt: skip
            audio = randn_tensor((g.audio_rows, g.audio_features), generator=generator, device=device,
                                 dtype=torch.float32)  # fmt: skip
            rows.append(self.layout.join(patchify_video_latents(video, g.patch)[None], audio[None]))
        return torch.cat(rows)

    def _packed_layout(self, text_length: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The transformer's layout inputs for a prompt of ``text_length`` tokens (the pipeline's layout step), built
        once per length and device."""
        if (text_length, device) in self._layouts:
            return self._layouts[text_length, device]
        pipeline, g = self.pipeline, self.geometry
        position_ids, tags, video, audio, text, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.full((text_length,), pipeline.text_tag, dtype=torch.long), g.frames, g.height, g.width,
            g.audio_latents, g.patch, g.audio_channels, pipeline.audio_tag, pipeline.video_tag,
        )  # fmt: skip
        float64 = torch.float64 if device.type in ("cpu", "cuda") else torch.float32  # (the rope casts to float32)
        self._layouts[text_length, device] = layout = {
            "position_ids": position_ids.to(device, float64),
            "token_tags": tags.to(device),
            "video_indices": video.to(device),
            "audio_indices": audio.to(device),
            "text_indices": text.to(device),
        }
        return layout

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        """``timestep``: (B, 2), each sample's video and audio ``1 − σ``."""
        video, audio = self.layout.split(latents)
        keys = list(zip(cond["prompt_length"].tolist(), map(tuple, timestep.tolist()), strict=True))  # (host read)
        output = None
        for key in dict.fromkeys(keys):
            (length, (video_time, audio_time)), rows = key, [i for i, other in enumerate(keys) if other == key]
            layout = self._packed_layout(length, latents.device)
            plan = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                layout["video_indices"].cpu(), layout["audio_indices"].cpu(), 0, 0, length, video_time, audio_time,
                max(video_time, self.pipeline.keyframe_noise_aug), 1.0,
            )  # fmt: skip
            index = torch.tensor(rows, device=latents.device)
            video_out, audio_out = model(
                hidden_states=video[index],
                audio_hidden_states=audio[index],
                encoder_hidden_states=cond["prompt_embeds"][index, :length],
                timestep=plan[0].to(latents.device),
                timestep_indices=plan[1].to(latents.device),
                return_dict=False,
                **layout,
            )
            velocity = -self.layout.join(video_out, audio_out)  # H3's data-ward velocity → ε − x0
            if len(rows) == len(keys):
                return velocity
            if output is None:
                output = velocity.new_empty(latents.shape[0], *velocity.shape[1:])
            output[index] = velocity
        return output

    def flop_tokens(self, inputs: dict[str, object]) -> dict[str, int]:
        video, audio = inputs["hidden_states"].shape[1], inputs["audio_hidden_states"].shape[1]
        text, batch = inputs["encoder_hidden_states"].shape[1], inputs["hidden_states"].shape[0]
        timesteps = inputs["timestep"].numel()  # (the AdaLN tables: per distinct timestep, shared by the batch)
        return {
            "video": video,
            "audio": audio,
            "text": text,
            "sequence": video + audio + text,
            SAMPLE: timesteps / batch,
        }

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        return self.layout.decode_audio(latents)
