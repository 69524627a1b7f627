"""Direct reward backpropagation (pure tensor math): SRPO's Direct-Align (arXiv 2509.06942) and its semantic-relative
preference.

The noising, the model step and the recovery of x̂0 from the known ε are the policy's forward process
(:mod:`trl_dance.forward_process`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# SRPO's control words (its `get_random_realism_adjective` / `get_random_cg_oily_adjective` lists), cycled by step.
POSITIVE_CONTROL_WORDS = ("Natural-lighting", "Detail", "Detailed", "Real")
NEGATIVE_CONTROL_WORDS = ("Concept art", "Painting", "Anime", "Flat", "Oil")


def shifted_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """SRPO's schedule: ``shift·t / (1 + (shift − 1)·t)`` of ``linspace(1, 0, num_steps + 1)``, float64 (N + 1,)."""
    t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)


def draw_positions(count: int, generator: torch.Generator, length: int = 1000) -> torch.Tensor:
    """SRPO's ``random.randint(5, length − 5)`` per item (both ends included): (count,) long positions in the table."""
    return torch.randint(5, length - 4, (count,), generator=generator)


def direct_align_levels(
    mid: torch.Tensor,
    inversion: torch.Tensor,
    window: torch.Tensor,
    gap: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SRPO's noise levels of one Direct-Align step per item.

    ``window`` (L,) is the σ table the steps are drawn from (``linspace(σ[a], σ[b], L)`` of the shifted schedule,
    decreasing); ``mid`` (B,) integer positions in [1, L − 1]; ``gap`` the step length in table entries
    (``⌊(1 − groundtruth_ratio)·L⌋ + 1``), shortened near the ends. The denoise branch steps from table index
    ``L − (mid + gap)`` (more noise) to ``L − mid``; the inversion branch (``inversion`` True) starts at
    ``m = max(mid − gap, 1)`` and steps from ``L − m`` to ``L − (m + gap)`` (toward more noise), as SRPO pairs them.

    Returns:
        ``sigma_from``, ``sigma_to`` (B,) and the index ``m`` (B,) the branch's discount is read at.
    """
    length = len(window)
    gap_t = torch.minimum(torch.minimum(torch.full_like(mid, gap), length - mid), mid)
    m = torch.where(inversion, (mid - gap_t).clamp(min=1), mid)
    far = (m + gap_t).clamp(max=length)
    near_sigma, far_sigma = window[length - m], window[(length - far).clamp(max=length - 1)]
    sigma_from = torch.where(inversion, near_sigma, far_sigma)
    sigma_to = torch.where(inversion, far_sigma, near_sigma)
    return sigma_from, sigma_to, m


def semantic_relative_reward(
    score: Callable[[list[str], torch.Tensor], torch.Tensor],
    prompts: Sequence[str],
    images: torch.Tensor,
    positive: str,
    negative: str,
    discount: torch.Tensor,
    swapped: torch.Tensor | None = None,
) -> torch.Tensor:
    """SRPO's semantic-relative preference ``(1 + k)·r(c⁺. p) − r(c⁻. p)`` per image (B,), with the discount ``k``
    (B,): for rewards linear in a unit text embedding (HPS, CLIP, PickScore) this is SRPO's
    ``⟨f_img, (1 + k)·f_txt(c⁺·p) − f_txt(c⁻·p)⟩``. Rows where ``swapped`` (B,) is True (SRPO's inversion branch)
    take the words' roles swapped, ``(1 + k)·r(c⁻. p) − r(c⁺. p)``, from the same two scorings."""
    with_positive = score([f"{positive}. {p}" for p in prompts], images)
    with_negative = score([f"{negative}. {p}" for p in prompts], images)
    if swapped is not None:
        swapped = swapped.to(with_positive.device)
        with_positive, with_negative = (
            torch.where(swapped, with_negative, with_positive),
            torch.where(swapped, with_positive, with_negative),
        )
    return (1 + discount.to(with_positive)) * with_positive - with_negative
