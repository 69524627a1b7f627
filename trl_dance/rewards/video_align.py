"""VideoAlign's VideoReward (Liu et al. 2025): Qwen2-VL-2B with a LoRA and a linear head read at three reward
tokens, visual quality (VQ), motion quality (MQ) and text alignment (TA) of a video."""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Mapping

import torch
from torch import nn

from .model_reward import resolve_directory
from .qwen2_vl import (
    Qwen2VLRewardModel,
    Qwen2VLScorer,
    build_scorer,
    legacy_key,
    prompt_template,
    qwen_size,
    resize_frames,
)

VIDEOALIGN_REPO = "KwaiVGI/VideoReward"
DIMENSIONS = ("VQ", "MQ", "TA")
VIDEO_MIN_PIXELS = 128 * 28 * 28  # qwen-vl-utils' lower bound on a frame's pixels (the reference sets only the max)
FPS_MIN_FRAMES, FPS_MAX_FRAMES, FRAME_FACTOR = 4, 768, 2  # qwen-vl-utils' frame-count rules


def sampled_frames(total: int, video_fps: float, fps: float | None, num_frames: int | None) -> list[int]:
    """Indices of the frames the reference feeds the model (qwen-vl-utils' ``smart_nframes``, uniform sampling):
    ``num_frames``, or ``fps`` frames per second of a ``video_fps`` video, even, at least 4, spread evenly.

    Raises:
        ValueError for a single-frame video: Qwen2-VL pairs frames in time.
    """
    if num_frames is not None:
        count = round(num_frames / FRAME_FACTOR) * FRAME_FACTOR
    else:
        low = math.ceil(FPS_MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        high = math.floor(min(FPS_MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
        count = round(min(max(total / video_fps * fps, low), high) / FRAME_FACTOR) * FRAME_FACTOR
    count = min(count, total)
    if count < FRAME_FACTOR or count % FRAME_FACTOR:
        raise ValueError(
            f"videoalign: a {total}-frame video gives {count} sampled frames; Qwen2-VL needs an even number (≥ 2): "
            "score videos of at least 2 frames"
        )
    return torch.linspace(0, total - 1, count).round().long().tolist()


class VideoAlignReward(Qwen2VLRewardModel):
    """VideoReward's VQ, MQ and TA of whole videos (``accepts_video``), normalised by the checkpoint's
    ``inference_config`` as ``VideoVLMRewardInference.reward(use_norm=True)`` does; the reward is one dimension,
    ``"Overall"`` (VQ + MQ + TA, the reference's), or a weighted sum.

    Frames are prepared as the reference prepares a video file: frames sampled at the checkpoint's ``fps`` (2) from a
    ``video_fps`` video, 8-bit, resized (antialiased bicubic) to at most ``max_frame_pixels`` in multiples of 28,
    the Qwen2-VL normalisation, two frames per temporal patch. Generated videos are scored as decoded frames, without
    the video codec the reference's files went through.

    Args:
        checkpoint: a directory, or Hub repo, in the published layout: ``model_config.json`` and ``checkpoint-STEP/``
            with ``model.pth`` (a PEFT model's state dict) or ``adapter_model.safetensors`` +
            ``non_lora_state_dict.pth``.
        dimension: ``"VQ"``, ``"MQ"``, ``"TA"``, ``"Overall"``, or weights such as ``{"VQ": 1.0, "MQ": 1.0}``.
        video_fps: frame rate of the videos scored (16 for Wan, 24 for HunyuanVideo).
        normalize: apply the checkpoint's means and standard deviations.
        base_model: the Qwen2-VL it was trained from (default: ``model_name_or_path`` of ``model_config.json``).
        step: which ``checkpoint-STEP`` (default: the latest, as the reference).
    """

    name = "videoalign"
    accepts_video = True
    vision_kind = "video"
    special_tokens = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")

    def __init__(
        self,
        checkpoint: str = VIDEOALIGN_REPO,
        dimension: str | Mapping[str, float] = "Overall",
        video_fps: float = 16.0,
        normalize: bool = True,
        base_model: str | None = None,
        step: int | None = None,
        dtype: torch.dtype | str = torch.bfloat16,
        batch_size: int = 2,
    ):
        super().__init__(base_model=base_model, dtype=dtype, batch_size=batch_size)
        weights = dict.fromkeys(DIMENSIONS, 1.0) if dimension == "Overall" else dimension
        if isinstance(weights, str):
            weights = {weights: 1.0}
        unknown = set(weights) - set(DIMENSIONS)
        if unknown:
            raise ValueError(f"videoalign: unknown dimension(s) {sorted(unknown)}; use {DIMENSIONS} or 'Overall'")
        self.weights = torch.tensor([float(weights.get(name, 0.0)) for name in DIMENSIONS])
        self.checkpoint, self.video_fps, self.normalize, self.step = checkpoint, video_fps, normalize, step
        self.template = prompt_template("videoalign")  # the reference's "detailed_special" prompt, verbatim

    def _load(self, device: torch.device) -> None:
        self.root = resolve_directory(self.checkpoint, "VideoAlign checkpoint", self.name, "checkpoint")
        with open(os.path.join(self.root, "model_config.json")) as file:
            self.settings = json.load(file)
        data, model = self.settings["data_config"], self.settings["model_config"]
        expected = {
            "data_config.prompt_template_type": (data.get("prompt_template_type"), "detailed_special"),
            "data_config.eval_dim": (data.get("eval_dim"), list(DIMENSIONS)),
            "data_config.sample_type": (data.get("sample_type", "uniform"), "uniform"),
            "model_config.reward_token": (model.get("reward_token"), "special"),
            "model_config.output_dim": (model.get("output_dim"), 1),
        }
        for field, (value, wanted) in expected.items():
            if value != wanted:
                raise ValueError(
                    f"videoalign: {field} = {value!r} is not supported (the published model has {wanted!r})"
                )
        if self.base_model is None:
            self.base_model = model["model_name_or_path"]
        stats = self.settings.get("inference_config") or {}
        if self.normalize and stats:
            self._affine = (
                torch.tensor([stats[f"{name}_mean"] for name in DIMENSIONS], dtype=torch.float64),
                torch.tensor([stats[f"{name}_std"] for name in DIMENSIONS], dtype=torch.float64),
            )
        else:
            self._affine = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        super()._load(device)

    def _checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The PEFT model's state dict of ``checkpoint-STEP`` (adapter names inserted as the reference loader does)."""
        steps = sorted(glob.glob(os.path.join(self.root, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
        if not steps:
            raise FileNotFoundError(f"videoalign: no checkpoint-STEP directory in {self.root}")
        directory = os.path.join(self.root, f"checkpoint-{self.step}") if self.step is not None else steps[-1]
        full = os.path.join(directory, "model.pth")
        if os.path.isfile(full):
            return torch.load(full, map_location="cpu", weights_only=True)
        from safetensors.torch import load_file

        state = torch.load(os.path.join(directory, "non_lora_state_dict.pth"), map_location="cpu", weights_only=True)
        for key, value in load_file(os.path.join(directory, "adapter_model.safetensors")).items():
            module, _, parameter = key.rpartition(".")  # "...q_proj.lora_A" + "weight"
            state[f"{module}.default.{parameter}"] = value
        return state

    def _load_scorer(self, config) -> Qwen2VLScorer:
        lora = self.settings.get("peft_lora_config", {})
        state = {}
        for key, value in self._checkpoint_state().items():
            new_key = legacy_key(key.removeprefix("base_model.model."))
            if new_key is not None:
                state[new_key] = value
        head = nn.Linear(config.text_config.hidden_size, 1, bias=False)
        if not lora.get("lora_enable", False):
            return build_scorer(config, head, state, self.dtype)
        exclude = lora.get("lora_namespan_exclude") or []
        count = lora.get("num_lora_modules", -1)

        def targets(scorer: nn.Module) -> list[str]:  # the reference's find_target_linear_names
            names = [
                name
                for name, module in scorer.named_modules()
                if isinstance(module, (nn.Linear, nn.Embedding)) and not any(word in name for word in exclude)
            ]
            return names[-count:] if count > 0 else names

        peft = {
            "target_modules": targets,
            "r": lora["lora_r"],
            "lora_alpha": lora["lora_alpha"],
            "use_rslora": lora.get("use_rslora", False),
        }
        return build_scorer(config, head, state, self.dtype, lora=peft)

    def _text(self, prompt: str) -> str:
        return self.template.format(text_prompt=prompt)

    def _frames(self, videos: torch.Tensor, exact: bool) -> torch.Tensor:
        data = self.settings["data_config"]
        batch, total, _, height, width = videos.shape
        index = sampled_frames(total, self.video_fps, data.get("fps"), data.get("num_frames"))
        size = qwen_size(height, width, min_pixels=VIDEO_MIN_PIXELS, max_pixels=data["max_frame_pixels"])
        frames = resize_frames(videos[:, index].flatten(0, 1), size, "uint8" if exact else "tensor")
        return frames.view(batch, len(index), 3, *size)

    def dimensions(self, prompts: list[str], videos: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """(B, 3) VQ, MQ, TA (normalised unless ``normalize=False``), differentiable unless ``exact``."""
        self._check(prompts, videos)
        self.load(videos.device)
        return self._dimensions(list(prompts), videos, exact)

    def _dimensions(self, prompts: list[str], videos: torch.Tensor, exact: bool) -> torch.Tensor:
        raw = super()._score(prompts, videos, exact)[:, :, 0]
        mean, std = (t.to(raw) for t in self._affine)
        return (raw - mean) / std

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        dimensions = self._dimensions(prompts, images, exact)
        return dimensions @ self.weights.to(dimensions)
