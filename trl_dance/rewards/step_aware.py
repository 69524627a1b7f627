"""SPO's step-aware preference model (arXiv 2406.04314): PickScore's CLIP whose vision tower is conditioned on the
diffusion timestep by adaptive layer norm, judging a noisy step by its predicted clean image.

Published checkpoints (``SPO-Diffusion-Models/Step-Aware_Preference_Models``: ``sd-v1-5_step-aware_preference_model.bin``,
``sdxl_step-aware_preference_model.bin``) are ``torch.save``'d state dicts of SPO's model: ``model.`` + a
``CLIPModel``'s keys, plus ``model.t_embedder.mlp.{0,2}`` (a sinusoidal timestep embedding's MLP),
``model.vision_model.encoder.layers.{i}.adaLN_modulation.1`` (shift, scale and gate of attention and MLP per layer) and
``model.vision_model.adaLN_modulation.1`` (shift and scale of the pooled output). The architecture is built from
PickScore's ``CLIPModel`` configuration (``yuvalkirstain/PickScore_v1``) on the meta device and assigned from the file.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import nn

from .image_transforms import CLIP_MEAN, CLIP_STD
from .model_reward import from_pretrained, resolve_file

SPM_REPOSITORY = "SPO-Diffusion-Models/Step-Aware_Preference_Models"


class TimestepEmbedder(nn.Module):
    """A scalar timestep to a vector: the sinusoidal features [cos, sin] of ``frequencies`` periods geometrically
    spaced up to 10⁴ (DiT's), through ``Linear → SiLU → Linear``."""

    def __init__(self, hidden_size: int, frequencies: int = 256):
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
        angles = timesteps.float()[:, None] * freqs[None]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


def _modulation(hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.SiLU(), nn.Linear(hidden, outputs * hidden))


class TimeConditionedCLIP(nn.Module):
    """A ``transformers.CLIPModel`` whose vision encoder layers are adaLN-modulated by a timestep embedding c:
    ``h += g₁·Attn(LN₁(h)·(1 + s₁) + b₁)``, ``h += g₂·MLP(LN₂(h)·(1 + s₂) + b₂)`` with (b₁, s₁, g₁, b₂, s₂, g₂) =
    Linear(SiLU(c)) per layer, and the pooled (post-layer-norm CLS) output modulated as ``p·(1 + s) + b``. With every
    modulation at (b, s, g) = (0, 0, 1) it is the plain CLIP model."""

    def __init__(self, clip):
        super().__init__()
        width = clip.config.vision_config.hidden_size
        self.clip = clip
        self.t_embedder = TimestepEmbedder(width)
        self.layer_modulations = nn.ModuleList(_modulation(width, 6) for _ in clip.vision_model.encoder.layers)
        self.pooled_modulation = _modulation(width, 2)

    def image_features(self, pixel_values: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """(B, P) projected image features of normalised pixels (B, 3, S, S) at model timesteps (B,)."""
        vision = self.clip.vision_model
        condition = self.t_embedder(timesteps)
        hidden = vision.pre_layrnorm(vision.embeddings(pixel_values))
        for layer, modulation in zip(vision.encoder.layers, self.layer_modulations):
            shift1, scale1, gate1, shift2, scale2, gate2 = (m[:, None] for m in modulation(condition).chunk(6, dim=1))
            attended = layer.self_attn(hidden_states=layer.layer_norm1(hidden) * (1 + scale1) + shift1)[0]
            hidden = hidden + gate1 * attended
            hidden = hidden + gate2 * layer.mlp(layer.layer_norm2(hidden) * (1 + scale2) + shift2)
        pooled = vision.post_layernorm(hidden[:, 0])
        shift, scale = self.pooled_modulation(condition).chunk(2, dim=1)
        return self.clip.visual_projection(pooled * (1 + scale) + shift)


def map_spm_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SPO's checkpoint keys to :class:`TimeConditionedCLIP`'s (position-id buffers, which older transformers saved,
    dropped)."""
    mapped = {}
    for key, value in state_dict.items():
        key = key.removeprefix("model.")
        if key.endswith("position_ids"):
            continue
        if key.startswith("vision_model.encoder.layers.") and ".adaLN_modulation." in key:
            index, rest = key.removeprefix("vision_model.encoder.layers.").split(".adaLN_modulation.")
            key = f"layer_modulations.{index}.{rest}"
        elif key.startswith("vision_model.adaLN_modulation."):
            key = "pooled_modulation." + key.removeprefix("vision_model.adaLN_modulation.")
        elif not key.startswith("t_embedder."):
            key = "clip." + key
        mapped[key] = value
    return mapped


class StepAwarePreferenceModel:
    """SPO's step scorer: ``(prompts (n), images (n, 3, H, W) in [0, 1], model timesteps (n,)) -> (n,)`` float32
    scores ``exp(logit_scale)·cos(image at t, prompt)`` (PickScore's units), as SPO's ``get_preference_score``:
    bicubic resize of the shorter side to the model's size (no antialiasing), centre crop, CLIP normalisation;
    prompts padded to 77 tokens. Pass it as ``SPOTrainer(step_scorer=...)`` or name the checkpoint in
    ``SPOConfig.step_aware_model``.

    Args:
        checkpoint: the ``.bin`` file, a folder holding ``filename``, or a Hub repo id (default SPO's).
        filename: the file in that folder or repo (``sd-v1-5_step-aware_preference_model.bin`` or
            ``sdxl_step-aware_preference_model.bin``).
        model: the ``CLIPModel`` whose configuration the checkpoint follows (PickScore_v1).
        tokenizer: its tokenizer (CLIP-H's).
    """

    name = "step_aware_preference"

    def __init__(
        self,
        checkpoint: str = SPM_REPOSITORY,
        filename: str = "sd-v1-5_step-aware_preference_model.bin",
        model: str = "yuvalkirstain/PickScore_v1",
        tokenizer: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int = 32,
    ):
        self.checkpoint, self.filename, self.model_location, self.tokenizer_location = (
            checkpoint,
            filename,
            model,
            tokenizer,
        )
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.batch_size = batch_size
        self.model = self.tokenizer = self.device = None
        self._lock = threading.Lock()

    def load(self, device: torch.device | str) -> StepAwarePreferenceModel:
        """Build the model on ``device`` unless it is there already."""
        from accelerate import init_empty_weights
        from transformers import AutoTokenizer, CLIPConfig, CLIPModel

        device = torch.device(device)
        with self._lock:
            if self.device == device:
                return self
            path = resolve_file(
                self.checkpoint, self.filename, "SPO step-aware preference model", self.name, "checkpoint"
            )
            config = from_pretrained(
                CLIPConfig.from_pretrained, self.model_location, "CLIP config", self.name, "model"
            )
            state_dict = map_spm_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            with init_empty_weights(include_buffers=False):
                model = TimeConditionedCLIP(CLIPModel(config))
            model.load_state_dict(state_dict, strict=True, assign=True)
            self.model = model.to(device, self.dtype).eval().requires_grad_(False)
            self.tokenizer = from_pretrained(
                AutoTokenizer.from_pretrained, self.tokenizer_location, "CLIP tokenizer", self.name, "tokenizer"
            )
            self.device = device
        return self

    @torch.no_grad()
    def __call__(self, prompts: list[str], images: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or len(prompts) != images.shape[0] != timesteps.shape[0]:
            raise ValueError(
                f"{self.name}: expected n prompts, images (n, 3, H, W) and timesteps (n,); got {len(prompts)}, "
                f"{tuple(images.shape)}, {tuple(timesteps.shape)}"
            )
        self.load(images.device)
        scores = [
            self._score(
                prompts[i : i + self.batch_size], images[i : i + self.batch_size], timesteps[i : i + self.batch_size]
            )
            for i in range(0, len(prompts), self.batch_size)
        ]
        return torch.cat(scores)

    def _score(self, prompts: list[str], images: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        clip = self.model.clip
        size = clip.config.vision_config.image_size
        scale = size / min(images.shape[-2:])
        resized = torch.nn.functional.interpolate(
            images.float(),
            size=(int(images.shape[-2] * scale + 0.5), int(images.shape[-1] * scale + 0.5)),
            mode="bicubic",
            align_corners=False,
        )
        # torchvision's CenterCrop offsets: round((side − size) / 2), half to even
        top, left = (int(round((side - size) / 2.0)) for side in resized.shape[-2:])
        pixels = resized[..., top : top + size, left : left + size].clamp(0, 1)
        mean, std = (torch.tensor(v, device=pixels.device).view(1, 3, 1, 1) for v in (CLIP_MEAN, CLIP_STD))
        image = self.model.image_features(((pixels - mean) / std).to(self.dtype), timesteps.to(self.device)).float()
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
        text = clip.get_text_features(input_ids=tokens["input_ids"].to(self.device))
        text = (text if isinstance(text, torch.Tensor) else text.pooler_output).float()
        image, text = image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)
        return clip.logit_scale.exp().float() * (image * text).sum(dim=-1)


__all__ = ["StepAwarePreferenceModel", "TimeConditionedCLIP", "map_spm_state_dict"]
