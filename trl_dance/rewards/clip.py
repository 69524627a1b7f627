"""CLIP-embedding rewards on ``transformers.CLIPModel``: CLIP score, PickScore, and the base HPS v2 builds on."""

from __future__ import annotations

import torch

from .image_transforms import reference_pixels, tensor_pixels
from .model_reward import RewardModel, from_pretrained


def _pooled(output) -> torch.Tensor:
    # get_*_features returns a tensor in transformers 4 and a model output in transformers 5.
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class CLIPReward(RewardModel):
    """Base of rewards computed from the normalised CLIP image and text embeddings of a ``CLIPModel``.

    Args:
        model: Hub id or local directory of a ``CLIPModel`` (``save_pretrained`` layout).
        tokenizer: Hub id or directory of its tokenizer; `None`: the model's.
        geometry: ``"crop"`` (resize shortest side, centre crop) or ``"pad"`` (resize longest side, pad).
    """

    default_model: str = ""
    needs_text: bool = True
    resample: str = "pil"  # how the exact path resizes (see reference_pixels): the scorer's own preprocessing
    # False: text that spells a special token becomes that token, as transformers' processors (PickScore's own
    # scoring code) tokenize; True: every character is text, as open_clip's tokenizer reads it.
    split_special_tokens: bool = False

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        geometry: str = "crop",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(dtype=dtype, batch_size=batch_size)
        if geometry not in ("crop", "pad"):
            raise ValueError(f"geometry must be 'crop' or 'pad', got {geometry!r}")
        self.model_location = model or self.default_model
        self.tokenizer_location = tokenizer or self.model_location
        self.geometry = geometry
        self.model = self.tokenizer = None

    def _build_model(self):
        from transformers import CLIPModel

        return from_pretrained(CLIPModel.from_pretrained, self.model_location, "CLIP model", self.name, "model")

    def _load(self, device: torch.device) -> None:
        from transformers import AutoTokenizer

        self.model = self._build_model().to(device, self.dtype).eval().requires_grad_(False)
        if self.needs_text:
            self.tokenizer = from_pretrained(
                AutoTokenizer.from_pretrained, self.tokenizer_location, "CLIP tokenizer", self.name, "tokenizer"
            )

    def image_embeddings(self, images: torch.Tensor, exact: bool) -> torch.Tensor:
        """(B, D) unit-norm image embeddings (:attr:`compute_dtype`) of images (B, 3, H, W) in [0, 1]."""
        size = self.model.config.vision_config.image_size
        # (the published scores of these models come through transformers' CLIPProcessor, which floors a crop's offset)
        images = images.to(self.device)
        if exact:
            pixels = reference_pixels(images, size, self.geometry, offset="floor", resample=self.resample)
        else:
            pixels = tensor_pixels(images, size, self.geometry, offset="floor")
        features = _pooled(self.model.get_image_features(pixel_values=pixels.to(self.dtype))).to(self.compute_dtype)
        return features / features.norm(dim=-1, keepdim=True)

    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """(B, D) unit-norm text embeddings (:attr:`compute_dtype`); prompts truncated to the model's context (77
        tokens)."""
        max_length = self.model.config.text_config.max_position_embeddings
        tokens = self.tokenizer(
            prompts,
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
            split_special_tokens=self.split_special_tokens,
        )
        features = self.model.get_text_features(
            input_ids=tokens["input_ids"].to(self.device), attention_mask=tokens["attention_mask"].to(self.device)
        )
        features = _pooled(features).to(self.compute_dtype)
        return features / features.norm(dim=-1, keepdim=True)

    def cosine(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        """(B,) cosine similarity of each image with its prompt."""
        return (self.image_embeddings(images, exact) * self.text_embeddings(prompts)).sum(dim=-1)


class CLIPScore(CLIPReward):
    """CLIP score (Hessel et al. 2021, as in torchmetrics): ``100 · max(cos(image, prompt), 0)``, in [0, 100];
    typically 20–35 for matching pairs with ``openai/clip-vit-large-patch14``."""

    name = "clip_score"
    default_model = "openai/clip-vit-large-patch14"

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        return 100 * self.cosine(prompts, images, exact).clamp(min=0)


class PickScore(CLIPReward):
    """PickScore (Kirstain et al. 2023): ``exp(logit_scale) · cos(image, prompt)`` of ``yuvalkirstain/PickScore_v1``
    with the CLIP-H tokenizer; typically 18–24."""

    name = "pickscore"
    default_model = "yuvalkirstain/PickScore_v1"

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **kwargs):
        super().__init__(model, tokenizer or "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", **kwargs)

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        return self.model.logit_scale.exp().to(self.compute_dtype) * self.cosine(prompts, images, exact)
