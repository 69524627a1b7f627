"""The reward packages users score with (``hpsv2``, ``image-reward``, open_clip), run on tiny random checkpoints,
offline.

scripts/setup_env.sh installs them with the dev extra, without their requirements (they pin 2023 releases of pytest,
timm and protobuf). What is changed here, and nothing else: the sizes their constructors hard-code (ViT-H-14,
ViT-L/16 with a 768-wide head), the two downloads (pretrained weights, ``bert-base-uncased``'s tokenizer, here a
local one), and five transformers 4 helpers that image-reward 1.5 uses and transformers 5 removed, restored with
their transformers 4 definitions. Their scoring functions, model classes and transforms run as published.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types

import torch


def hpsv2_package_model(architecture: dict, directory: str):
    """The ``hpsv2`` package's model and ``preprocess_val`` for ``architecture`` (``TINY_HPS``'s layout), built with
    the arguments of its ``img_score.initialize_model`` for ViT-H-14, less the pretrained weights it downloads."""
    from hpsv2.src.open_clip import create_model_and_transforms
    from hpsv2.src.open_clip.factory import add_model_config

    vision, text = architecture["vision_config"], architecture["text_config"]
    config = {
        "embed_dim": architecture["projection_dim"],
        "vision_cfg": {
            "image_size": vision["image_size"],
            "layers": vision["num_hidden_layers"],
            "width": vision["hidden_size"],
            "head_width": vision["hidden_size"] // vision["num_attention_heads"],
            "patch_size": vision["patch_size"],
            "mlp_ratio": vision["intermediate_size"] / vision["hidden_size"],
        },
        "text_cfg": {  # (its text tower has no mlp_ratio: 4)
            "context_length": text["max_position_embeddings"],
            "vocab_size": text["vocab_size"],
            "width": text["hidden_size"],
            "heads": text["num_attention_heads"],
            "layers": text["num_hidden_layers"],
        },
    }
    path = os.path.join(directory, "tiny-hps.json")
    with open(path, "w") as handle:
        json.dump(config, handle)
    add_model_config(path)
    model, _, preprocess_val = create_model_and_transforms(
        "tiny-hps",
        None,
        precision="amp",
        device="cpu",
        jit=False,
        force_quick_gelu=False,
        force_custom_text=False,
        force_patch_dropout=False,
        force_image_size=None,
        pretrained_image=False,
        image_mean=None,
        image_std=None,
        light_augmentation=True,
        aug_cfg={},
        output_dict=True,
        with_score_predictor=False,
        with_region_predictor=False,
    )
    return model, preprocess_val


def open_clip_model(architecture: dict, quick_gelu: bool = False):
    """open_clip's own ``CLIP`` for ``architecture`` (``TINY_OPEN_CLIP``'s layout), in eval mode, random weights."""
    import open_clip

    vision, text = architecture["vision_config"], architecture["text_config"]
    return open_clip.CLIP(
        embed_dim=architecture["projection_dim"],
        vision_cfg={
            "width": vision["hidden_size"],
            "layers": vision["num_hidden_layers"],
            "head_width": vision["hidden_size"] // vision["num_attention_heads"],
            "patch_size": vision["patch_size"],
            "image_size": vision["image_size"],
            "mlp_ratio": vision["intermediate_size"] / vision["hidden_size"],
        },
        text_cfg={
            "context_length": text["max_position_embeddings"],
            "vocab_size": text["vocab_size"],
            "width": text["hidden_size"],
            "heads": text["num_attention_heads"],
            "layers": text["num_hidden_layers"],
            "mlp_ratio": text["intermediate_size"] / text["hidden_size"],
        },
        quick_gelu=quick_gelu,
    ).eval()


def _invert_attention_mask(self, mask: torch.Tensor) -> torch.Tensor:
    """transformers 4's ``ModuleUtilsMixin.invert_attention_mask``: 1 → 0, 0 → the dtype's lowest value."""
    mask = mask[:, None, :, :] if mask.dim() == 3 else mask[:, None, None, :]
    return (1.0 - mask.to(self.dtype)) * torch.finfo(self.dtype).min


def _get_head_mask(self, head_mask, num_hidden_layers: int):
    """transformers 4's ``get_head_mask`` for the only case scoring reaches: no head mask."""
    if head_mask is not None:
        raise NotImplementedError("head masks are not used by ImageReward's scoring")
    return [None] * num_hidden_layers


def load_image_reward_package(monkeypatch, architecture: dict, checkpoint: str, bert_tokenizer: str, directory: str):
    """``ImageReward.load`` (the image-reward package) of ``checkpoint`` with ``architecture``'s sizes (TINY_BLIP's
    layout): the package's ImageReward model, whose ``score(prompt, pil_image)`` is what its users call."""
    import transformers.modeling_utils
    import transformers.pytorch_utils

    for name in ("apply_chunking_to_forward", "prune_linear_layer"):  # moved to pytorch_utils in transformers 5
        monkeypatch.setattr(
            transformers.modeling_utils, name, getattr(transformers.pytorch_utils, name), raising=False
        )
    monkeypatch.setattr(transformers.modeling_utils, "find_pruneable_heads_and_indices", None, raising=False)
    try:
        import clip  # noqa: F401  (OpenAI's, for the package's CLIPScore baseline, which scoring never calls)
    except ImportError:
        monkeypatch.setitem(sys.modules, "clip", types.ModuleType("clip"))
    import ImageReward

    package = importlib.import_module("ImageReward.ImageReward")
    from ImageReward.models.BLIP import blip, blip_pretrain, med, vit

    monkeypatch.setattr(med.BertPreTrainedModel, "all_tied_weights_keys", {}, raising=False)  # init_weights in 5
    monkeypatch.setattr(med.BertPreTrainedModel, "invert_attention_mask", _invert_attention_mask, raising=False)
    monkeypatch.setattr(med.BertPreTrainedModel, "get_head_mask", _get_head_mask, raising=False)

    class LocalBertTokenizer(blip.BertTokenizer):
        @classmethod
        def from_pretrained(cls, name, *args, **kwargs):
            return super().from_pretrained(bert_tokenizer if name == "bert-base-uncased" else name, *args, **kwargs)

        @property
        def additional_special_tokens_ids(self) -> list[int]:  # transformers 4's name
            return self.convert_tokens_to_ids(self.extra_special_tokens)

    vision, text = architecture["vision_config"], architecture["text_config"]

    def create_vit(name, image_size, *args):
        encoder = vit.VisionTransformer(
            img_size=image_size,
            patch_size=vision["patch_size"],
            embed_dim=vision["hidden_size"],
            depth=vision["num_hidden_layers"],
            num_heads=vision["num_attention_heads"],
            mlp_ratio=vision["intermediate_size"] / vision["hidden_size"],
        )
        return encoder, vision["hidden_size"]

    monkeypatch.setattr(blip, "BertTokenizer", LocalBertTokenizer)
    monkeypatch.setattr(blip_pretrain, "create_vit", create_vit)
    mlp = package.MLP
    monkeypatch.setattr(package, "MLP", lambda input_size: mlp(text["hidden_size"]))
    med_config = {  # the published med_config.json's fields, at these sizes
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": text["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": text["intermediate_size"],
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": text["max_position_embeddings"],
        "model_type": "bert",
        "num_attention_heads": text["num_attention_heads"],
        "num_hidden_layers": text["num_hidden_layers"],
        "pad_token_id": 0,
        "type_vocab_size": 2,
        "vocab_size": text["vocab_size"],
        "encoder_width": vision["hidden_size"],
        "add_cross_attention": True,
    }
    path = os.path.join(directory, "med_config.json")
    with open(path, "w") as handle:
        json.dump(med_config, handle)
    return ImageReward.load(checkpoint, device="cpu", med_config=path)
