"""The linear score head shared by ImageReward and the LAION improved-aesthetic predictor."""

from __future__ import annotations

import torch
from torch import nn


class LinearStackHead(nn.Module):
    """``input → 1024 → 128 → 64 → 16 → 1`` linear layers with no activation between them (the dropouts of the
    published models sit at indices 1, 3, 5 and are identities at inference), so state-dict keys are
    ``layers.{0,2,4,6,7}.{weight,bias}`` as in both checkpoints. Input (B, input_size), output (B,)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        widths = [input_size, 1024, 128, 64, 16]
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < 3:
                layers.append(nn.Identity())
        layers.append(nn.Linear(16, 1))
        self.layers = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features).squeeze(-1)
