"""Qwen2-VL reward models (HPSv3, VideoAlign): a Qwen2-VL read by a reward head at special tokens of the prompt.

Both references subclass transformers 4.45's ``Qwen2VLForConditionalGeneration``; their forward embeds the tokens,
scatters the vision tower's merged patch embeddings into the ``<|image_pad|>``/``<|video_pad|>`` positions, and runs
the language model **without position ids**, which in 4.45 (and 5.x) means positions 0..L-1 on all three M-RoPE
axes, not Qwen2-VL's 3-D image positions. :class:`Qwen2VLScorer` reproduces that forward on transformers 5's
``Qwen2VLModel`` (no LM head: only the hidden states are read).

Images reach the vision tower as the Qwen2-VL image processor makes them (resize to multiples of 28, rescale,
normalise, 14×14 patches with two temporal slices, grouped 2×2 for the merger); :func:`patchify` is that layout on
tensors, so the same code serves 8-bit references and the differentiable path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from .image_transforms import to_uint8
from .model_reward import RewardModel, from_pretrained

# transformers 4.45 Qwen2VLForConditionalGeneration keys → Qwen2VLScorer keys (``lm_head`` is not used).
_LEGACY_PREFIXES = (("visual.", "model.visual."), ("model.", "model.language_model."), ("rm_head.", "rm_head."))


def prompt_template(name: str) -> str:
    """A reference's user message (``rewards/prompts/NAME.txt``, verbatim) with a ``{text_prompt}`` field."""
    return resources.files("trl_dance.rewards").joinpath("prompts", f"{name}.txt").read_text(encoding="utf-8")


def legacy_key(key: str) -> str | None:
    """The :class:`Qwen2VLScorer` key of a transformers-4.45 reward-model key; None for the unused ``lm_head``.

    Raises:
        KeyError for a key of neither layout.
    """
    for old, new in _LEGACY_PREFIXES:
        if key.startswith(old):
            return new + key[len(old) :]
    if key.startswith("lm_head."):
        return None
    raise KeyError(f"unexpected Qwen2-VL reward-model key {key!r}")


class Qwen2VLScorer(nn.Module):
    """Qwen2-VL trunk (``model``: transformers' ``Qwen2VLModel``) and a reward head (``rm_head``) read at special
    tokens, in float32 when ``head_float32`` (HPSv3 keeps its head in float32 under a bfloat16 trunk)."""

    def __init__(self, model: nn.Module, head: nn.Module, head_float32: bool = False):
        super().__init__()
        self.model = model
        self.rm_head = head
        self.head_float32 = head_float32

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        special_ids: Sequence[int],
    ) -> torch.Tensor:
        """Head outputs (B, S, D) at the S special tokens of each row (input_ids (B, L), right-padded)."""
        config = self.model.config
        embeds = self.model.get_input_embeddings()(input_ids)
        visual = self.model.visual
        vision = visual(pixel_values.to(visual.dtype), grid_thw=grid_thw).pooler_output
        vision_mask = (input_ids == config.image_token_id) | (input_ids == config.video_token_id)
        if int(vision_mask.sum()) != vision.shape[0]:
            raise ValueError(f"{int(vision_mask.sum())} vision tokens in the text for {vision.shape[0]} embeddings")
        embeds = embeds.masked_scatter(vision_mask.unsqueeze(-1), vision.to(embeds.dtype))
        hidden = self.model.language_model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state
        special = torch.isin(input_ids, torch.tensor(list(special_ids), device=input_ids.device))
        counts = special.sum(dim=1)
        if not bool((counts == len(special_ids)).all()):
            raise ValueError(f"every row needs its {len(special_ids)} reward tokens once, found {counts.tolist()}")
        picked = hidden[special]  # row-major: (B·S, hidden), special tokens in text order
        if self.head_float32:
            picked = picked.float() if picked.dtype != torch.float64 else picked
        return self.rm_head(picked).view(input_ids.shape[0], len(special_ids), -1)


def build_scorer(
    config,
    head: nn.Module,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    head_float32: bool = False,
    lora: dict | None = None,
) -> Qwen2VLScorer:
    """A :class:`Qwen2VLScorer` holding ``state_dict`` (its own keys), built without initialising random weights.

    The vocabulary size comes from the checkpoint (the references resize the embeddings after adding their reward
    tokens). Parameters are created on the meta device and assigned from the checkpoint; buffers (rotary
    frequencies) are computed normally.

    Args:
        lora: ``peft.LoraConfig`` arguments when ``state_dict`` is a PEFT model's (``base_layer``/``lora_A.default``
            keys, without the ``base_model.model.`` prefix); the adapter is loaded with peft and merged.
            ``target_modules`` may be a function of the scorer returning module names.
    """
    from accelerate import init_empty_weights
    from transformers import Qwen2VLModel

    config.text_config.vocab_size = state_dict["model.language_model.embed_tokens.weight"].shape[0]
    with init_empty_weights(include_buffers=False):
        trunk = Qwen2VLModel._from_config(config, attn_implementation="sdpa")
    scorer = Qwen2VLScorer(trunk, head, head_float32)
    head_dtype = torch.float32 if head_float32 and dtype != torch.float64 else dtype
    state_dict = {
        key: value.to(head_dtype if key.startswith("rm_head.") else dtype) for key, value in state_dict.items()
    }
    if lora is None:
        scorer.load_state_dict(state_dict, strict=True, assign=True)
        return scorer.eval().requires_grad_(False)
    from peft import LoraConfig, get_peft_model

    targets = lora["target_modules"]
    lora = {**lora, "target_modules": targets(scorer) if callable(targets) else targets}
    peft_model = get_peft_model(scorer, LoraConfig(**lora))
    peft_model.load_state_dict({f"base_model.model.{k}": v for k, v in state_dict.items()}, strict=True, assign=True)
    return peft_model.merge_and_unload().eval().requires_grad_(False)


def patchify(
    frames: torch.Tensor, patch_size: int, temporal_patch_size: int, merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL's patch layout of normalised frames (B, T, C, H, W); an image (T = 1) is repeated in time.

    Returns:
        pixel_values (B·t·h·w, C·temporal_patch_size·patch_size²) in the image processor's order (time, merge
        blocks row-major, the 2×2 patches of a block, then channel, time slice, pixel row, pixel column), and
        grid_thw (B, 3) = (t, h, w) patches per item.
    """
    batch, time, channels, height, width = frames.shape
    if time == 1:
        frames = frames.expand(batch, temporal_patch_size, channels, height, width)
        time = temporal_patch_size
    if time % temporal_patch_size or height % (patch_size * merge_size) or width % (patch_size * merge_size):
        raise ValueError(
            f"frames (T={time}, H={height}, W={width}) must be multiples of ({temporal_patch_size}, "
            f"{patch_size * merge_size}, {patch_size * merge_size})"
        )
    grid = (time // temporal_patch_size, height // patch_size, width // patch_size)
    blocks = frames.reshape(
        batch,
        grid[0],
        temporal_patch_size,
        channels,
        grid[1] // merge_size,
        merge_size,
        patch_size,
        grid[2] // merge_size,
        merge_size,
        patch_size,
    ).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    pixel_values = blocks.reshape(batch * math.prod(grid), channels * temporal_patch_size * patch_size**2)
    grid_thw = torch.tensor([grid] * batch, device=frames.device)
    return pixel_values, grid_thw


def resize_frames(images: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """(N, 3, H, W) in [0, 1] → (N, 3, h, w) in [0, 1], float32 (float64 stays float64).

    Modes: ``"pil"``: 8-bit, PIL bicubic (qwen-vl-utils on images); ``"uint8"``: 8-bit, torch antialiased bicubic,
    clamped and rounded back to 8 bits (torchvision's resize of uint8 video frames); ``"tensor"``: antialiased
    bicubic on the floats (differentiable).
    """
    height, width = size
    if mode == "pil":
        arrays = [
            np.asarray(Image.fromarray(array).resize((width, height), Image.BICUBIC)) for array in to_uint8(images)
        ]
        return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).to(images.device, torch.float32) / 255
    if mode == "uint8":
        pixels = torch.from_numpy(to_uint8(images)).permute(0, 3, 1, 2).to(images.device, torch.float32)
        pixels = F.interpolate(pixels, size=size, mode="bicubic", align_corners=False, antialias=True)
        return pixels.clamp(0, 255).round() / 255
    pixels = images.to(torch.promote_types(images.dtype, torch.float32))
    if tuple(pixels.shape[-2:]) != (height, width):
        pixels = F.interpolate(pixels, size=size, mode="bicubic", align_corners=False, antialias=True)
    return pixels


class Qwen2VLRewardModel(RewardModel):
    """Shared loading and scoring of the Qwen2-VL reward models.

    Subclasses set ``special_tokens`` and implement :meth:`_load_scorer` (weights, on the CPU), :meth:`_text` (the
    user message of one prompt) and :meth:`_frames` ((B, T, 3, h, w) resized frames in [0, 1]); ``_score`` returns
    the head outputs (B, S, D).

    Args:
        base_model: Hub id or directory of the Qwen2-VL the reward was trained from: its ``config.json``, tokenizer
            (chat template included) and ``preprocessor_config.json`` (patch size, normalisation).
    """

    special_tokens: tuple[str, ...] = ()
    vision_kind: str = "image"  # which pad token stands for the frames: "image" | "video"

    def __init__(self, base_model: str, dtype: torch.dtype | str = torch.bfloat16, batch_size: int = 8):
        super().__init__(dtype=dtype, batch_size=batch_size)
        self.base_model = base_model

    def _load(self, device: torch.device) -> None:
        from transformers import AutoConfig, AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        what = f"{self.name} base model (Qwen2-VL)"
        # The references' processors pad on the right; positions then start at 0 in every row.
        self.tokenizer = from_pretrained(AutoTokenizer.from_pretrained, self.base_model, what, self.name, "base_model")
        self.tokenizer.padding_side = "right"
        self.tokenizer.add_special_tokens({"additional_special_tokens": list(self.special_tokens)})
        self.special_ids = self.tokenizer.convert_tokens_to_ids(list(self.special_tokens))
        self.processor = from_pretrained(
            Qwen2VLImageProcessorPil.from_pretrained, self.base_model, what, self.name, "base_model"
        )
        config = from_pretrained(AutoConfig.from_pretrained, self.base_model, what, self.name, "base_model")
        self.scorer = self._load_scorer(config).to(device)
        mean = torch.tensor(self.processor.image_mean, device=device, dtype=self.compute_dtype)
        std = torch.tensor(self.processor.image_std, device=device, dtype=self.compute_dtype)
        self._mean_std = (mean.view(1, 1, 3, 1, 1), std.view(1, 1, 3, 1, 1))

    def _load_scorer(self, config) -> Qwen2VLScorer:
        raise NotImplementedError

    def _text(self, prompt: str) -> str:
        raise NotImplementedError

    def _frames(self, images: torch.Tensor, exact: bool) -> torch.Tensor:
        raise NotImplementedError

    def _inputs(self, prompts: list[str], images: torch.Tensor, exact: bool) -> dict[str, torch.Tensor]:
        """Token ids, attention mask, pixel values and grid of a batch, as the reference processor builds them."""
        mean, std = self._mean_std
        frames = (self._frames(images, exact).to(mean.dtype) - mean) / std
        processor = self.processor
        pixel_values, grid_thw = patchify(
            frames, processor.patch_size, processor.temporal_patch_size, processor.merge_size
        )
        pad = f"<|{self.vision_kind}_pad|>"
        tokens_per_item = int(grid_thw[0].prod()) // processor.merge_size**2
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": [{"type": self.vision_kind}, {"type": "text", "text": self._text(p)}]}],
                tokenize=False,
                add_generation_prompt=True,
            ).replace(pad, pad * tokens_per_item)
            for p in prompts
        ]
        encoded = self.tokenizer(texts, padding=True, return_tensors="pt").to(images.device)
        return {**encoded, "pixel_values": pixel_values, "grid_thw": grid_thw}

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        inputs = self._inputs(prompts, images, exact)
        out = self.scorer(
            inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"], inputs["grid_thw"], self.special_ids
        )
        return out.to(self.compute_dtype)


def qwen_size(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: sides in multiples of 28 near (height, width) with min ≤ h·w ≤ max pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
