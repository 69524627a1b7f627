"""HPSv3 (Ma et al. 2025): Qwen2-VL-7B with a RankNet head read at a ``<|Reward|>`` token; the reward is the
head's mean μ of its (μ, σ) output, typically −5…15 for generated images."""

from __future__ import annotations

import torch
from torch import nn

from .model_reward import resolve_file
from .qwen2_vl import (
    Qwen2VLRewardModel,
    Qwen2VLScorer,
    build_scorer,
    legacy_key,
    prompt_template,
    qwen_size,
    resize_frames,
)

HPSV3_REPO = "MizzenAI/HPSv3"
HPSV3_FILE = "HPSv3.safetensors"
HPSV3_PIXELS = 256 * 28 * 28  # the reference resizes every image to this many pixels (448×448 for a square)


def ranknet_head(hidden_size: int, outputs: int = 2) -> nn.Sequential:
    """HPSv3's ``rm_head``: Linear(h, 1024)–ReLU–Dropout–Linear(1024, 16)–ReLU–Linear(16, outputs) (keys 0, 3, 5)."""
    return nn.Sequential(
        nn.Linear(hidden_size, 1024),
        nn.ReLU(),
        nn.Dropout(0.05),
        nn.Linear(1024, 16),
        nn.ReLU(),
        nn.Linear(16, outputs),
    )


class HPSv3Reward(Qwen2VLRewardModel):
    """HPSv3: μ of the RankNet head at ``<|Reward|>``, as ``HPSv3RewardInferencer.reward`` returns it in ``[:, 0]``.

    Images are converted as the reference does: 8-bit RGB, PIL bicubic resize to ``pixels`` (qwen-vl-utils'
    ``smart_resize``, multiples of 28), the Qwen2-VL normalisation; the text is the reference instruction with the
    prompt, through the base model's chat template. The trunk runs in ``dtype`` (bfloat16 as published), the head
    in float32.

    Args:
        checkpoint: ``HPSv3.safetensors``, a directory holding it, or a Hub repo id (``MizzenAI/HPSv3``).
        base_model: the Qwen2-VL it was trained from (config, tokenizer, image processor).
        pixels: the reference's ``min_pixels = max_pixels``.
    """

    name = "hpsv3"
    special_tokens = ("<|Reward|>",)

    def __init__(
        self,
        checkpoint: str = HPSV3_REPO,
        base_model: str = "Qwen/Qwen2-VL-7B-Instruct",
        pixels: int = HPSV3_PIXELS,
        dtype: torch.dtype | str = torch.bfloat16,
        batch_size: int = 8,
    ):
        super().__init__(base_model=base_model, dtype=dtype, batch_size=batch_size)
        self.checkpoint = checkpoint
        self.pixels = pixels
        self.template = prompt_template("hpsv3")  # the reference's instruction + "<|Reward|>" request, verbatim

    def _load_scorer(self, config) -> Qwen2VLScorer:
        from safetensors.torch import load_file

        path = resolve_file(self.checkpoint, HPSV3_FILE, "HPSv3 checkpoint", self.name, "checkpoint")
        state_dict = {}
        for key, value in load_file(path).items():
            new_key = legacy_key(key)
            if new_key is not None:
                state_dict[new_key] = value
        head = ranknet_head(config.text_config.hidden_size)
        return build_scorer(config, head, state_dict, self.dtype, head_float32=True)

    def _text(self, prompt: str) -> str:
        return self.template.format(text_prompt=prompt)

    def _frames(self, images: torch.Tensor, exact: bool) -> torch.Tensor:
        size = qwen_size(*images.shape[-2:], min_pixels=self.pixels, max_pixels=self.pixels)
        return resize_frames(images, size, "pil" if exact else "tensor").unsqueeze(1)

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        return super()._score(prompts, images, exact)[:, 0, 0]  # μ of (μ, σ)
