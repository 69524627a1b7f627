"""HPS v2.1 (Wu et al. 2023): an open_clip ViT-H-14 fine-tuned on human preferences, run as a ``CLIPModel``."""

from __future__ import annotations

import re
from typing import Any

import torch

from .clip import CLIPReward
from .model_reward import resolve_file

HPS_REPO = "xswu/HPSv2"
HPS_V21_FILE = "HPS_v2.1_compressed.pt"

# open_clip's ViT-H-14 (vision: width 1280, 32 layers, head width 80; text: width 1024, 24 layers, 16 heads).
VIT_H_14 = {
    "vision_config": {
        "hidden_size": 1280,
        "intermediate_size": 5120,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "patch_size": 14,
        "image_size": 224,
        "hidden_act": "gelu",
    },
    "text_config": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "max_position_embeddings": 77,
        "vocab_size": 49408,
        "hidden_act": "gelu",
    },
    "projection_dim": 1024,
}


def clip_config(architecture: dict[str, Any]):
    """A ``CLIPConfig`` for an open_clip architecture dict (``VIT_H_14`` layout).

    The text tower pools the highest token id, as open_clip does (``eos_token_id=2`` selects that rule in
    transformers; open_clip uses no other special-token ids); layer-norm epsilon is open_clip's 1e-5.
    """
    from transformers import CLIPConfig

    text = {"eos_token_id": 2, "bos_token_id": None, "pad_token_id": None, "layer_norm_eps": 1e-5}
    text.update(architecture["text_config"])
    vision = {"layer_norm_eps": 1e-5, **architecture["vision_config"]}
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=architecture["projection_dim"])


# open_clip key → (CLIPModel key, transpose: open_clip projections are (D, P) matrices applied as x @ proj).
_RENAMES = {
    "visual.conv1.weight": ("vision_model.embeddings.patch_embedding.weight", False),
    "visual.class_embedding": ("vision_model.embeddings.class_embedding", False),
    "visual.positional_embedding": ("vision_model.embeddings.position_embedding.weight", False),
    "visual.ln_pre.weight": ("vision_model.pre_layrnorm.weight", False),
    "visual.ln_pre.bias": ("vision_model.pre_layrnorm.bias", False),
    "visual.ln_post.weight": ("vision_model.post_layernorm.weight", False),
    "visual.ln_post.bias": ("vision_model.post_layernorm.bias", False),
    "visual.proj": ("visual_projection.weight", True),
    "token_embedding.weight": ("text_model.embeddings.token_embedding.weight", False),
    "positional_embedding": ("text_model.embeddings.position_embedding.weight", False),
    "ln_final.weight": ("text_model.final_layer_norm.weight", False),
    "ln_final.bias": ("text_model.final_layer_norm.bias", False),
    "text_projection": ("text_projection.weight", True),
    "logit_scale": ("logit_scale", False),
}
_BLOCK_RENAMES = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
    "attn.out_proj": "self_attn.out_proj",
}


def open_clip_to_transformers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an open_clip CLIP state dict (``visual.*``, ``transformer.*``, ...) to ``CLIPModel`` keys.

    Fused attention projections ``in_proj_weight`` (3D, D) are split into q/k/v; ``visual.proj`` and
    ``text_projection`` (D, P) are transposed into ``Linear`` weights (P, D).

    Raises:
        KeyError naming the first key that has no counterpart.
    """
    out = {}
    for key, value in state_dict.items():
        key = key.removeprefix("module.")
        tower, rest = ("vision_model", key[len("visual.") :]) if key.startswith("visual.") else ("text_model", key)
        block = re.fullmatch(r"transformer\.resblocks\.(\d+)\.(.+)", rest)
        if block:
            index, name = block.groups()
            prefix = f"{tower}.encoder.layers.{index}"
            if name.startswith("attn.in_proj_"):
                kind = name.rsplit("_", 1)[1]  # weight | bias
                for proj, chunk in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                    out[f"{prefix}.self_attn.{proj}.{kind}"] = chunk
                continue
            module, _, kind = name.rpartition(".")
            if module not in _BLOCK_RENAMES:
                raise KeyError(f"unexpected open_clip key {key!r}")
            out[f"{prefix}.{_BLOCK_RENAMES[module]}.{kind}"] = value
            continue
        if key not in _RENAMES:
            raise KeyError(f"unexpected open_clip key {key!r}")
        new_key, transpose = _RENAMES[key]
        out[new_key] = value.t() if transpose else value
    return {key: value.contiguous() for key, value in out.items()}


class HPSv2Reward(CLIPReward):
    """HPS v2.1: cosine of the unit-norm image and prompt embeddings of the HPS checkpoint; typically 0.20–0.35.

    Images are converted as the ``hpsv2`` package's ``preprocess_val`` does: 8-bit RGB to a float tensor, longest
    side to 224 (antialiased bicubic on the tensor), centred on a black square, CLIP normalisation. Prompts use the
    CLIP BPE tokenizer (open_clip's, as published in ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``) read as open_clip
    reads them: that tokenizer's pad token is ``"!"``, which transformers would otherwise cut out of a prompt as a
    special token (diffusers#4153), so ``"wow!"`` would not score as hpsv2 scores it.

    Args:
        checkpoint: the ``HPS_v2.1_compressed.pt`` file, a directory holding it, or a Hub repo id (``xswu/HPSv2``).
        tokenizer: Hub id or directory of the CLIP tokenizer.
        architecture: open_clip architecture in the ``VIT_H_14`` layout (tests pass a tiny one).
    """

    name = "hpsv2"
    resample = "tensor"
    split_special_tokens = True

    def __init__(
        self,
        checkpoint: str = HPS_REPO,
        tokenizer: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        architecture: dict[str, Any] | None = None,
        **kwargs,
    ):
        super().__init__(model=checkpoint, tokenizer=tokenizer, geometry="pad", **kwargs)
        self.architecture = architecture or VIT_H_14

    def _build_model(self):
        from transformers import CLIPModel

        path = resolve_file(self.model_location, HPS_V21_FILE, "HPS v2.1 checkpoint", self.name, "checkpoint")
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        state_dict = checkpoint.get("state_dict", checkpoint)
        model = CLIPModel(clip_config(self.architecture))
        model.load_state_dict(open_clip_to_transformers(state_dict), strict=True)
        return model

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        return self.cosine(prompts, images, exact)
