"""Audio rewards for audio-video families (LTX-2): the CLAP text–audio score on ``transformers.ClapModel``, and the
band-limited resampling that brings a vocoder's waveforms to the scorer's rate."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .model_reward import RewardModel, from_pretrained


def resample(
    waveform: torch.Tensor, orig_rate: int, new_rate: int, zeros: int = 16, rolloff: float = 0.99
) -> torch.Tensor:
    """Band-limited resampling of waveforms (..., T) from ``orig_rate`` to ``new_rate`` Hz: each output sample is the
    input interpolated by a Hann-windowed sinc of ``zeros`` zero crossings, low-passed at ``rolloff`` × the lower
    Nyquist frequency. Returns (..., ⌈T·new/orig⌉) float32, sample 0 at time 0.

    (torchaudio's ``functional.resample`` computes this; it publishes no wheel for this project's torch.)
    """
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} and {new_rate}")
    divisor = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // divisor, new_rate // divisor
    waveform = waveform.float()
    if orig == new:
        return waveform
    cutoff = min(orig, new) * rolloff  # in cycles per (orig·new) units: the kernel's sinc rate
    width = math.ceil(zeros * orig / cutoff)  # input samples each side of an output sample's position
    # Output phase j of every block of `new` outputs sits at input position j·orig/new; tap k reads input k − width.
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    distance = (taps[None, :] - torch.arange(new, dtype=torch.float64)[:, None] / new) * cutoff
    distance = distance.clamp(-zeros, zeros)
    window = torch.cos(distance * math.pi / zeros / 2) ** 2
    kernel = torch.sinc(distance) * window * cutoff / orig  # (new, K): unit DC gain per phase
    shape, length = waveform.shape, waveform.shape[-1]
    padded = F.pad(waveform.reshape(-1, 1, length), (width, width + orig))
    blocks = F.conv1d(padded, kernel.to(padded)[:, None, :], stride=orig)  # (N, new phases, blocks)
    out = blocks.transpose(1, 2).reshape(len(padded), -1)[:, : math.ceil(new * length / orig)]
    return out.reshape(*shape[:-1], out.shape[-1])


class CLAPScore(RewardModel):
    """CLAP score (LAION-CLAP, Wu et al. 2023): the cosine similarity, in [−1, 1], of a soundtrack's and its prompt's
    CLAP embeddings — an audio reward (``modality = "audio"``: routed to the audio stream on LTX-2). The waveforms
    (B, channels, samples) are averaged to mono and resampled to the feature extractor's rate (48 kHz) before its
    log-mel features; clips longer than the extractor's 10 s are fused or randomly cropped as the checkpoint's processor
    config says (``truncation``). Not differentiable (the features are computed in numpy).

    Args:
        model: Hub id or local directory of a ``ClapModel`` with its ``ClapProcessor`` (``save_pretrained``
            layout); default ``laion/larger_clap_general`` (general audio; ``laion/larger_clap_music_and_speech``,
            ``laion/clap-htsat-unfused`` also load).
        processor: directory or id of the processor; ``None``: the model's.
    """

    name = "clap"
    default_model = "laion/larger_clap_general"
    accepts_video = True  # (receives whole videos beside the soundtracks, scores only the latter)
    accepts_audio = True
    modality = "audio"

    def __init__(
        self,
        model: str | None = None,
        processor: str | None = None,
        dtype: torch.dtype | str = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(dtype=dtype, batch_size=batch_size)
        self.model_location = model or self.default_model
        self.processor_location = processor or self.model_location
        self.model = self.processor = None

    def _load(self, device: torch.device) -> None:
        from transformers import ClapModel, ClapProcessor

        model = from_pretrained(ClapModel.from_pretrained, self.model_location, "CLAP model", self.name, "model")
        self.model = model.to(device, self.dtype).eval().requires_grad_(False)
        self.processor = from_pretrained(
            ClapProcessor.from_pretrained, self.processor_location, "CLAP processor", self.name, "processor"
        )

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        raise TypeError("CLAP scores soundtracks: call it with audio= and audio_sample_rate=, as the trainers do")

    def audio_score(self, prompts: list[str], audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
        """(B,) CLAP scores (:attr:`compute_dtype`) of waveforms ``audio`` (B, channels, samples) at ``sample_rate``
        Hz against their prompts."""
        extractor = self.processor.feature_extractor
        mono = resample(audio.float().mean(dim=1).cpu(), sample_rate, extractor.sampling_rate)
        inputs = self.processor(
            text=list(prompts),
            audio=list(mono.numpy()),
            sampling_rate=extractor.sampling_rate,
            padding=True,
            return_tensors="pt",
        )
        inputs = {k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
        output = self.model(**inputs)
        audio_embeds, text_embeds = (
            output.audio_embeds.to(self.compute_dtype),
            output.text_embeds.to(self.compute_dtype),
        )
        return (audio_embeds * text_embeds).sum(dim=-1)  # (both unit-norm)

    @torch.no_grad()
    def __call__(
        self, prompts: list[str], images: torch.Tensor, audio: torch.Tensor, audio_sample_rate: int, **_
    ) -> list[float]:
        if not isinstance(audio, torch.Tensor) or audio.ndim != 3 or len(audio) != len(prompts):
            shape = tuple(audio.shape) if isinstance(audio, torch.Tensor) else type(audio).__name__
            raise ValueError(
                f"{self.name}: expected one waveform (channels, samples) per prompt, got {shape} for {len(prompts)} prompts"
            )
        self.load(images.device)
        return self._in_batches(lambda chunk, waves: self.audio_score(chunk, waves, audio_sample_rate), prompts, audio)


def av_sync(prompts: list[str], images: torch.Tensor, audio: torch.Tensor, **_) -> list[float]:
    """Audio–video synchrony, in [−1, 1]: the Pearson correlation, over a video's F − 1 frame steps, between its motion
    (mean absolute change of a pixel from frame t − 1 to t) and its soundtrack's loudness while frame t shows (the RMS
    of the mono mix over the t-th of F equal windows). Sounds that start with the motion score high. A model-free
    example of a reward that judges both streams (``modality = "both"``); DeSync-style scorers (Synchformer) are the
    learned version. A video whose motion or loudness does not vary scores 0.

    Args:
        images: (B, F, 3, H, W) videos in [0, 1], F >= 3.
        audio: (B, channels, samples) waveforms covering the videos.
    """
    if images.ndim != 5 or images.shape[1] < 3:
        raise ValueError(f"av_sync scores videos (B, F >= 3, 3, H, W), got {tuple(images.shape)}")
    frames = images.shape[1]
    motion = (images[:, 1:] - images[:, :-1]).abs().float().mean(dim=(2, 3, 4))  # (B, F − 1)
    mono = audio.float().mean(dim=1)
    windows = mono[:, : mono.shape[1] // frames * frames].reshape(len(mono), frames, -1)
    loudness = windows.pow(2).mean(dim=2).sqrt()[:, 1:]  # (B, F − 1): while frames 1 … F − 1 show
    motion, loudness = motion - motion.mean(dim=1, keepdim=True), loudness - loudness.mean(dim=1, keepdim=True)
    scale = motion.norm(dim=1) * loudness.norm(dim=1)
    correlation = (motion * loudness).sum(dim=1) / scale.clamp_min(1e-12)
    return torch.where(scale > 1e-12, correlation, torch.zeros_like(correlation)).tolist()


av_sync.accepts_video = True
av_sync.accepts_audio = True
av_sync.modality = "both"
