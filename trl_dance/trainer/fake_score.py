"""DMD's fake score: a second, trained copy of the trained tensors with its own optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .._compat import _reparametrize_module
from .old_policy import OldPolicy


class FakeScore(OldPolicy):
    """A float32 copy of a module's trainable tensors (the student's LoRA, or the whole denoiser) trained by its own
    AdamW, and forwards of the module with it in their place (peft, the Trainer's optimizer, DDP and DeepSpeed never
    see it): :attr:`model` without gradients (:class:`OldPolicy`'s), :meth:`in_place` for a forward and its backward.
    It starts equal to the student, as verl-omni's ``fake_score`` adapter (with a zero-initialised LoRA: the teacher,
    as DMD2's), or to ``initial``.

    Args:
        module: the denoiser whose trainable tensors are copied (and the fake score's forwards run).
        learning_rate, weight_decay, betas, eps: its AdamW's.
        max_grad_norm: clip of its gradient norm (0: none).
        initial: the tensors to start from instead, by the module's parameter names (a separate teacher's: the fake
            score then runs on the teacher, as DMD2 initialises it).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        learning_rate: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        max_grad_norm: float = 0.0,
        initial: dict[str, torch.Tensor] | None = None,
    ):
        super().__init__(module, initial)
        for value in self.params.values():
            value.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()), lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay
        )
        self.max_grad_norm = max_grad_norm
        self.extra: list[torch.Tensor] = []  # trained beside it (DMD2's GAN head), in the same AdamW

    def add_parameters(self, params: list[torch.Tensor]) -> None:
        """Train ``params`` with the fake score: in its AdamW (a new group, the same settings), its gradient average
        over processes and its gradient clip (saved by their owner; the optimizer state travels here)."""
        self.extra += params
        self.optimizer.add_param_group({"params": params})

    @contextmanager
    def in_place(self) -> Iterator[torch.nn.Module]:
        """The module with the fake score's tensors in place of the trained ones, differentiable in them, for a forward
        *and the backward through it* (call ``backward`` inside): activation checkpointing recomputes each block in the
        backward from the tensors the module holds then. (A ``functional_call`` substitution ends with the forward, so
        the recomputation ran on the student's tensors: 94 % of a tiny FLUX LoRA's fake-score gradient was wrong.)"""
        with _reparametrize_module(self.module, self.params):
            yield self.module

    def step(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One AdamW update from the accumulated gradients, first averaged over processes by ``reduce`` (one flat
        all-reduce); returns the gradient norm before clipping (0-dim)."""
        params = [*self.params.values(), *self.extra]
        flat = reduce(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]))
        for p, grad in zip(params, flat.split([p.numel() for p in params])):
            p.grad = grad.view_as(p)
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm if self.max_grad_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict:
        return {"params": super().state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            super().load_state_dict(state["params"])
        self.optimizer.load_state_dict(state["optimizer"])


__all__ = ["FakeScore"]
