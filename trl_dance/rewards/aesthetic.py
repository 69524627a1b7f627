"""LAION improved aesthetic predictor: a linear head on unit-norm CLIP ViT-L/14 image embeddings (DDPO's reward)."""

from __future__ import annotations

import torch

from .clip import CLIPReward
from .heads import LinearStackHead
from .model_reward import resolve_file

AESTHETIC_REPO = "trl-lib/ddpo-aesthetic-predictor"
AESTHETIC_FILE = "aesthetic-model.pth"  # the same weights as sac+logos+ava1-l14-linearMSE.pth


class AestheticReward(CLIPReward):
    """Predicted aesthetic rating on a 1–10 scale (typically 4–7), from the image alone.

    Args:
        head: the predictor's state dict file (``sac+logos+ava1-l14-linearMSE.pth`` or ``aesthetic-model.pth``), a
            directory holding ``aesthetic-model.pth``, or a Hub repo id.
        model: Hub id or directory of the CLIP model (``openai/clip-vit-large-patch14``).
    """

    name = "aesthetic"
    default_model = "openai/clip-vit-large-patch14"
    needs_text = False

    def __init__(self, head: str = AESTHETIC_REPO, model: str | None = None, **kwargs):
        super().__init__(model=model, **kwargs)
        self.head_location = head

    def _load(self, device: torch.device) -> None:
        super()._load(device)
        path = resolve_file(self.head_location, AESTHETIC_FILE, "LAION aesthetic predictor head", self.name, "head")
        self.head = LinearStackHead(self.model.config.projection_dim)
        self.head.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
        self.head = self.head.to(device, self.dtype).eval().requires_grad_(False)

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        return self.head(self.image_embeddings(images, exact).to(self.dtype)).to(self.compute_dtype)
