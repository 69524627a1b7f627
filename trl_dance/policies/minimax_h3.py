"""MiniMax-H3 (joint audio+video rectified flow on a Qwen3-VL text encoder, guidance-distilled): one transformer call
denoises a packed sequence ``[text | audio rows | video rows]``, the video rows on a σ grid of shift 12 and the audio
rows on one of shift 3, with a data-ward velocity (x0 = x + σ·v)."""

from __future__ import annotations

import dataclasses

import torch
from diffusers import MiniMaxH3ModularPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep
from diffusers.modular_pipelines.minimax_h3.encoders import (
    MiniMaxH3FL2VATextEncoderStep,
    MiniMaxH3KeyframeVaeEncoderStep,
    get_qwen3vl_prompt_embeds,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    align_num_frames,
    audio_latent_num_frames,
    video_latent_num_frames,
)
from diffusers.utils.torch_utils import randn_tensor

from ..flops import SAMPLE, FlopLayout
from ..sde import dance_sigmas
from .base import Conditioning, DiffusionPolicy, SamplerSettings, grouped_forward, step_after_given
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
    anchors: tuple[str, ...] = ()  # keyframe conditions (fl2va), "first" / "last", in packed order

    @property
    def anchor_size(self) -> int:
        """Elements of a row holding the keyframes' noise (one latent frame each), before its video rows."""
        return len(self.anchors) * self.latent_channels * self.height * self.width

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
    row-major, as the pipeline packs them) then its channel-major audio rows, flattened; with keyframe conditions
    (fl2va), the noise their anchors are drawn with first (``geometry.anchor_size`` elements, given, not sampled)."""

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
        video, audio = latents[:, g.anchor_size :].split(list(self.streams.values()), dim=1)
        return video.reshape(batch, g.video_rows, g.video_channels), audio.reshape(batch, g.audio_rows, -1)

    @staticmethod
    def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split` (without the anchors' part, which leads a row)."""
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
    Keyframes (``fl2va``): rows with ``image`` / ``last_image`` columns (:meth:`encode_prompts`); their anchors' noise
    leads each row, given. The ``ref2va`` workflow and forward-process methods (one σ per sample) are not supported.
    """

    pipeline: MiniMaxH3ModularPipeline
    layout_class = PackedAudioVideoLatents
    optional_condition_columns = ("image", "last_image")  # the fl2va workflow's keyframes
    has_audio = True
    supports_cfg = False
    default_num_frames = 124  # 17·7 + 5: the pipeline's default, its shortest clip (5 s at 24 fps)
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
        self._layouts: dict[tuple, tuple[dict, torch.Tensor, torch.Tensor]] = {}

    def use_condition_columns(self, columns: list[str]) -> None:
        """Rows with ``image`` / ``last_image`` columns run the ``fl2va`` workflow: the keyframes anchored to the
        first / last latent frame."""
        super().use_condition_columns(columns)
        anchors = tuple(a for a, c in (("first", "image"), ("last", "last_image")) if c in self.condition_columns)
        self.layout.geometry = dataclasses.replace(self.geometry, anchors=anchors)
        self._layouts.clear()

    @property
    def pipeline_tag(self) -> str:
        return "image-to-video" if self.geometry.anchors else "text-to-video"

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

    def _encode_prompts(self, prompts: list[str], **columns: list) -> Conditioning:
        """``t2va``: each prompt alone (:meth:`_encode`). ``fl2va``: each prompt with its keyframes, through the
        pipeline's own blocks (the keyframes put onto the canvas; a label and a vision block per keyframe before the
        prompt, read by Qwen3-VL, its rows tagged video; the keyframes' VAE latents), stored padded with their token
        tags and the keyframes' latents (B, K·C·h·w)."""
        if not self.geometry.anchors:
            return super()._encode_prompts(prompts, **columns)
        with self._text_encoders_on_device():
            rows = [
                self._encode_keyframes(
                    prompt, *(columns.get(name, [None] * len(prompts))[i] for name in ("image", "last_image"))
                )
                for i, prompt in enumerate(prompts)
            ]
        return {key: torch.cat([row[key] for row in rows]).to(self.device) for key in rows[0]}

    @torch.no_grad()
    def _encode_keyframes(self, prompt: str, image, last_image) -> Conditioning:
        pipeline, settings, length = self.pipeline, self.settings, self.settings.max_sequence_length
        if getattr(pipeline, "image_processor", None) is None:  # (a t2va-loaded pipeline: its resize step's default)
            pipeline.update_components(image_processor=VaeImageProcessor(vae_scale_factor=16))
        state = PipelineState()
        inputs = {"prompt": prompt, "image": image, "last_image": last_image, "height": settings.height}
        for name, value in (inputs | {"width": settings.width}).items():
            state.set(name, value)
        for block in (MiniMaxH3ResizeStep(), MiniMaxH3FL2VATextEncoderStep(), MiniMaxH3KeyframeVaeEncoderStep()):
            _, state = block(pipeline, state)
        embeds, tags = state.get("prompt_embeds"), state.get("text_token_tags")
        if embeds.shape[1] > length:
            raise ValueError(
                f"a prompt with its keyframes' vision tokens is {embeds.shape[1]} tokens, more than max_sequence_length "
                f"({length}): raise it"
            )
        latents = torch.cat([latent.flatten(1) for latent in state.get("condition_latents")], dim=1)
        return padded_prompt(embeds, None, length) | {
            "prompt_length": torch.tensor([embeds.shape[1]]),
            "text_token_tags": torch.nn.functional.pad(tags, (0, length - len(tags)), value=pipeline.text_tag)[None],
            "condition_latents": latents.to(embeds.device),
        }

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Each sample's keyframe-anchor noise (one draw per keyframe, fl2va), video noise (as a latent tensor, then
        patchified) and audio rows from its generator, in the pipeline's order."""
        g, device = self.geometry, self.device
        rows = []
        for generator in generators:
            anchors = [
                randn_tensor((1, g.latent_channels, 1, g.height, g.width), generator=generator, device=device,
                             dtype=torch.float32).flatten(1)
                for _ in g.anchors
            ]  # fmt: skip
            video = randn_tensor(
                (1, g.latent_channels, g.frames, g.height, g.width), generator=generator, device=device,
                dtype=torch.float32,
            )  # fmt: skip
            audio = randn_tensor((g.audio_rows, g.audio_features), generator=generator, device=device,
                                 dtype=torch.float32)  # fmt: skip
            rows.append(
                torch.cat([*anchors, self.layout.join(patchify_video_latents(video, g.patch)[None], audio[None])], 1)
            )
        return torch.cat(rows)

    def _packed_layout(
        self, text_tags: tuple[int, ...], device: torch.device
    ) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """The transformer's layout inputs for a prompt with these per-token tags (the pipeline's layout step, with
        the keyframes' anchors), and its video and audio row indices on the host (for the timestep plans), built once
        per tags and device."""
        if (text_tags, device) in self._layouts:
            return self._layouts[text_tags, device]
        pipeline, g = self.pipeline, self.geometry
        position_ids, tags, video, audio, text, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.tensor(text_tags, dtype=torch.long), g.frames, g.height, g.width, g.audio_latents, g.patch,
            g.audio_channels, pipeline.audio_tag, pipeline.video_tag, g.anchors,
        )  # fmt: skip
        float64 = torch.float64 if device.type in ("cpu", "cuda") else torch.float32  # (the rope casts to float32)
        layout = {
            "position_ids": position_ids.to(device, float64),
            "token_tags": tags.to(device),
            "video_indices": video.to(device),
            "audio_indices": audio.to(device),
            "text_indices": text.to(device),
        }
        self._layouts[text_tags, device] = layout, video, audio
        return layout, video, audio

    def _condition_rows(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """(B, K·rows, C_v): the keyframes' latents noised to the anchors' ``t`` (0.999) with the row's anchor noise,
        as the pipeline noises them (the scheduler's ``scale_noise``), patchified."""
        g, pipeline = self.geometry, self.pipeline
        shape = (len(latents), len(g.anchors), g.latent_channels, 1, g.height, g.width)
        noise = latents[:, : g.anchor_size].float().view(shape)
        clean = cond["condition_latents"].float().view(shape)
        parts = [
            pipeline.scheduler.scale_noise(clean[:, k], pipeline.keyframe_noise_aug, noise[:, k])
            for k in range(len(g.anchors))
        ]
        return torch.cat(
            [patchify_video_latents(part, g.patch).view(len(latents), -1, g.video_channels) for part in parts], 1
        )

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        """``timestep``: (B, 2), each sample's video and audio ``1 − σ``."""
        g, pipeline = self.geometry, self.pipeline
        video, audio = self.layout.split(latents)
        conditions = self._condition_rows(latents, cond) if g.anchors else video[:, :0]
        given = conditions.shape[1]
        tags = cond.get("text_token_tags")
        lengths = cond["prompt_length"].tolist()  # (host reads)
        keys = [
            (tuple(tags[i, :n].tolist()) if tags is not None else (pipeline.text_tag,) * n, tuple(times))
            for i, (n, times) in enumerate(zip(lengths, timestep.tolist(), strict=True))
        ]

        def forward(key: tuple, rows: list[int]) -> torch.Tensor:
            text_tags, (video_time, audio_time) = key
            (layout, video_rows, audio_rows), length = self._packed_layout(text_tags, latents.device), len(text_tags)
            plan = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                video_rows, audio_rows, given, 0, length, video_time, audio_time,
                max(video_time, pipeline.keyframe_noise_aug), 1.0,
            )  # fmt: skip
            index = torch.tensor(rows, device=latents.device)
            video_out, audio_out = model(
                hidden_states=torch.cat([conditions[index], video[index]], dim=1),
                audio_hidden_states=audio[index],
                encoder_hidden_states=cond["prompt_embeds"][index, :length],
                timestep=plan[0].to(latents.device),
                timestep_indices=plan[1].to(latents.device),
                return_dict=False,
                **layout,
            )
            velocity = -self.layout.join(video_out[:, given:], audio_out)  # H3's data-ward velocity → ε − x0
            if g.anchor_size:  # (the anchors' noise is given: no velocity)
                velocity = torch.cat([velocity.new_zeros(len(rows), g.anchor_size), velocity], dim=1)
            return velocity

        return grouped_forward(keys, forward)

    def step(self, model_output: torch.Tensor, latents: torch.Tensor, step_index: torch.Tensor, **options):
        given = self.geometry.anchor_size
        if not given:
            return super().step(model_output, latents, step_index, **options)
        # The keyframes' anchor noise carries over unchanged (the anchors are held at t = 0.999 every step).
        return step_after_given(super().step, model_output, latents, step_index, given, 1, **options)

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

    def context_parallel_lengths(self) -> dict[str, int]:
        raise NotImplementedError(
            "MiniMax-H3's packed sequence (text, keyframe, audio and video rows) changes length with each prompt and has "
            "no padding; diffusers' plan splits it whole, and evening it out would need a key mask its blocks do not "
            "pass: context parallelism is not supported for it yet"
        )

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        return self.layout.decode_audio(latents)
