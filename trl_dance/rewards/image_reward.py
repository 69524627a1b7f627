"""ImageReward (Xu et al. 2023): BLIP ViT-L image encoder, BLIP text encoder with cross-attention, linear head."""

from __future__ import annotations

import re
from typing import Any

import torch

from .heads import LinearStackHead
from .image_transforms import reference_pixels, tensor_pixels
from .model_reward import RewardModel, from_pretrained, resolve_file

IMAGE_REWARD_REPO = "THUDM/ImageReward"
IMAGE_REWARD_FILE = "ImageReward.pt"
# The published normalisation of ImageReward-v1.0's raw head output.
IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072

# BLIP ViT-L/16 at 224 px and BLIP's BERT-base text encoder (med_config.json) with cross-attention to it.
BLIP_LARGE = {
    "vision_config": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "patch_size": 16,
        "image_size": 224,
    },
    "text_config": {
        "vocab_size": 30524,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 512,
    },
}

_VISION_RENAMES = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VISION_BLOCK_RENAMES = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def blip_configs(architecture: dict[str, Any]):
    """``(BlipVisionConfig, BlipTextConfig)`` for an architecture in the ``BLIP_LARGE`` layout, with BLIP's
    layer-norm epsilons (1e-6 vision, 1e-12 text) and cross-attention from the text to the image tokens."""
    from transformers import BlipTextConfig, BlipVisionConfig

    vision = BlipVisionConfig(layer_norm_eps=1e-6, hidden_act="gelu", **architecture["vision_config"])
    text = BlipTextConfig(
        layer_norm_eps=1e-12,
        hidden_act="gelu",
        encoder_hidden_size=vision.hidden_size,
        is_decoder=True,  # builds the cross-attention layers; the forward runs bidirectionally
        **architecture["text_config"],
    )
    return vision, text


def split_image_reward_state_dict(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split an ``ImageReward.pt`` state dict into ``BlipVisionModel``, ``BlipTextModel`` and head state dicts.

    Other ``blip.*`` entries (BLIP's pre-training projections) are not used by the score and are dropped.

    Raises:
        KeyError naming the first vision-encoder key that has no counterpart.
    """
    vision, text, head = {}, {}, {}
    for key, value in state_dict.items():
        if key.startswith("blip.visual_encoder."):
            name = key[len("blip.visual_encoder.") :]
            block = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
            if block and block.group(2) in _VISION_BLOCK_RENAMES:
                index, module, kind = block.groups()
                vision[f"encoder.layers.{index}.{_VISION_BLOCK_RENAMES[module]}.{kind}"] = value
            elif name in _VISION_RENAMES:
                vision[_VISION_RENAMES[name]] = value
            else:
                raise KeyError(f"unexpected ImageReward vision key {key!r}")
        elif key.startswith("blip.text_encoder."):
            name = key[len("blip.text_encoder.") :]
            if name != "embeddings.position_ids":  # a buffer transformers rebuilds
                text[name] = value
        elif key.startswith("mlp."):
            head[key[len("mlp.") :]] = value
    return vision, text, head


class ImageReward(RewardModel):
    """ImageReward-v1.0: ``(head(text[CLS] attending to the image) − 0.1672) / 1.0333``; typically −2 to 2.

    Images are converted as ImageReward does: 8-bit RGB, shortest side to 224 (bicubic), centre crop, CLIP
    normalisation. Prompts are BERT-tokenized, padded/truncated to 35 tokens.

    Args:
        checkpoint: the ``ImageReward.pt`` file, a directory holding it, or a Hub repo id (``THUDM/ImageReward``).
        tokenizer: Hub id or directory of the BERT tokenizer (``bert-base-uncased``).
        architecture: BLIP architecture in the ``BLIP_LARGE`` layout (tests pass a tiny one).
    """

    name = "image_reward"
    max_length = 35

    def __init__(
        self,
        checkpoint: str = IMAGE_REWARD_REPO,
        tokenizer: str = "bert-base-uncased",
        architecture: dict[str, Any] | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.checkpoint = checkpoint
        self.tokenizer_location = tokenizer
        self.architecture = architecture or BLIP_LARGE

    def _load(self, device: torch.device) -> None:
        from transformers import AutoTokenizer, BlipTextModel, BlipVisionModel

        path = resolve_file(self.checkpoint, IMAGE_REWARD_FILE, "ImageReward checkpoint", self.name, "checkpoint")
        vision_state, text_state, head_state = split_image_reward_state_dict(
            torch.load(path, map_location="cpu", weights_only=True)
        )
        vision_config, text_config = blip_configs(self.architecture)
        self.vision = BlipVisionModel(vision_config)
        self.vision.load_state_dict(vision_state, strict=True)
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.text.load_state_dict(text_state, strict=True)
        self.head = LinearStackHead(text_config.hidden_size)
        self.head.load_state_dict(head_state, strict=True)
        for module in ("vision", "text", "head"):
            setattr(self, module, getattr(self, module).to(device, self.dtype).eval().requires_grad_(False))
        self.tokenizer = from_pretrained(
            AutoTokenizer.from_pretrained,
            self.tokenizer_location,
            "ImageReward tokenizer (BERT)",
            self.name,
            "tokenizer",
        )

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        size = self.vision.config.image_size
        pixels = (reference_pixels if exact else tensor_pixels)(images.to(self.device), size, "crop")
        image_tokens = self.vision(pixel_values=pixels.to(self.dtype)).last_hidden_state
        tokens = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        text = self.text(
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            encoder_hidden_states=image_tokens,
            encoder_attention_mask=torch.ones(image_tokens.shape[:2], dtype=torch.long, device=self.device),
        ).last_hidden_state
        raw = self.head(text[:, 0].to(self.dtype)).to(self.compute_dtype)
        return (raw - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD
