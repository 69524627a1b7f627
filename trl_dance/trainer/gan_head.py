"""DMD2's GAN classifier: a head on the fake score's intermediate features, and the tap that reads them (its losses:
:func:`~trl_dance.losses.gan_discriminator_loss`, :func:`~trl_dance.losses.gan_generator_loss`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .speed import block_list


class FeatureTap:
    """The input hidden states (B, N, D) of one block of a denoiser, captured in the forwards run inside
    :meth:`capture` (and only there).

    DMD2 puts its classifier on the fake score's bottleneck features (the UNet's mid-block; for a transformer, a block's
    input); ``index`` picks the block in the denoiser's longest list of one class (FLUX's single-stream blocks, SD3's
    joint blocks, Wan's blocks), negative from the end, default the middle. That one block runs eager if it was
    compiled: dynamo does not guard on module hooks, so a compiled block would ignore a hook added later.
    """

    def __init__(self, denoiser: torch.nn.Module, index: int | None = None):
        blocks = block_list(denoiser)
        if not blocks:
            raise ValueError(
                f"{type(denoiser).__name__} has no list of transformer blocks for the GAN head to read features from"
            )
        index = len(blocks) // 2 if index is None else index
        if not -len(blocks) <= index < len(blocks):
            raise ValueError(f"gan_feature_block={index} is out of range: the denoiser has {len(blocks)} blocks")
        self.index = index % len(blocks)
        self.block = blocks[self.index]
        self.block._compiled_call_impl = None  # eager (see above); a no-op when it was not compiled
        self._captured: list[torch.Tensor] | None = None
        self.block.register_forward_pre_hook(self._hook, with_kwargs=True)  # for the trainer's lifetime

    def _hook(self, module, args, kwargs) -> None:
        if self._captured is not None:
            self._captured.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """A list that receives the block's input of each forward run inside (one per denoiser call; under activation
        checkpointing the backward's recomputation, outside, adds nothing)."""
        captured: list[torch.Tensor] = []
        self._captured = captured
        try:
            yield captured
        finally:
            self._captured = None


class GANHead(torch.nn.Module):
    """DMD2's classifier as a per-token head on a transformer's features: LayerNorm → Linear(D, D) → SiLU →
    Linear(D, 1), averaged over the tokens (a patch discriminator): one logit per sample, float32. Its layers are
    built at the first features seen (D, the block's width, is known then) or by :meth:`build` (a resume)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = seed
        self.layers: torch.nn.Sequential | None = None

    def build(self, dim: int, device: torch.device | str) -> None:
        """Create the layers for features of width ``dim``, initialised from ``seed`` (torch's default initialisation;
        the global random state is left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            layers = torch.nn.Sequential(
                torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim), torch.nn.SiLU(), torch.nn.Linear(dim, 1)
            )
        self.layers = layers.to(device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` (B, N, D) of any float dtype → logits (B,) float32."""
        if self.layers is None:
            self.build(features.shape[-1], features.device)
        return self.layers(features.float()).squeeze(-1).mean(dim=1)


__all__ = ["FeatureTap", "GANHead"]
