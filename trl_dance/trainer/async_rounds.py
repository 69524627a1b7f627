"""Asynchronous rounds: rollouts launched ``max_staleness`` rounds ahead, their rewards scored in the background.

A round is *launched* (rollouts on the main thread, rewards submitted to the reward worker) and later *consumed*
(rewards awaited and gathered, advantages, micro-batches). With ``max_staleness = s`` round ``j`` is launched when
round ``j − s`` starts, by the weights after ``v(j) = max(v0, j − s)`` trained rounds (``v0``: the first round of
this run): the binding is fixed by the config, never by timing, so a run is reproducible and resumes exactly. At
``s = 0`` a round is launched and consumed at once: the synchronous loop. Design: ``docs/scaling.md``.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset

from ..sampling import RolloutPlan

IS_MODES = ("truncate", "mask")


@dataclass
class AsyncRoundsArguments:
    r"""
    The asynchronous-round fields of the online RL trainers' configs.

    Parameters:
        max_staleness (`int`, defaults to `0`): s, in rounds: round j is sampled by the weights after
            max(v0, j − s) trained rounds and its rewards run in the background (the reward worker thread, a
            `serve-reward` server, a remote judge) while up to s later rounds roll out and train, hiding a reward
            that takes up to s × (rollout + training) time. 0: the synchronous loop (bit-identical). Needs a
            map-style dataset; DanceGRPO (and its variants), DiffusionNFT/AWM/DGPO and online Diffusion-DPO.
        importance_sampling_correction (`bool`, defaults to `True`): GRPO family at staleness > 0: decoupled PPO. The
            ratio is clipped against the weights at the round's start (π_prox) and each transition is weighted by
            w = exp(log π_prox − log μ) of π_prox over the sampling weights μ (truncated, detached). `False`: the
            ratio against μ ("bypass"), which a tight `epsilon` clips to zero gradient.
        importance_sampling_mode (`str`, defaults to `"truncate"`): `"truncate"`: w capped to
            [`importance_sampling_clip_min`, `importance_sampling_clip_max`] (ours: every transition keeps a bounded
            gradient); `"mask"`: transitions with w outside dropped (AReaL's decoupled PPO, arXiv 2505.24298, masks
            above its cap, 5 in its newer default: `"mask"` with `importance_sampling_clip_max` 5).
        importance_sampling_clip_max (`float`, defaults to `2.0`), importance_sampling_clip_min (`float` or `None`,
            defaults to `None`): the bounds of w (`None`: 0).
        rollout_server_urls (`list[str]` or `None`, defaults to `None`): `trl-dance serve-rollouts` workers that sample
            every chunk instead of the training processes (a LoRA; one process's chunks go round the workers). Each
            version of the rollout weights is published before the chunks it samples; an answer counts only if it
            names its round's version and the SHA-256 of the worker's live LoRA equals the published one, and
            `rollout_audit_transitions` of each chunk's stored transitions are recomputed by the trainer under that
            version with the step's noise drawn again (the stored next state within `rollout_audit_tolerance` of the
            step's stds; `None`: 1e-3 in float32, 0.1 under autocast). With `max_staleness` ≥ 1 the trainer trains
            while the workers sample. Design and guarantees: docs/scaling.md.
        rollout_server_timeout (`float`, defaults to `240.0`): seconds to wait at construction for every worker to be
            ready (loading its model); one that refuses connections for 10 s is taken for not running.
        rollout_request_timeout (`float`, defaults to `600.0`): seconds per request (a chunk's rollout included);
            after its retries a worker's chunk goes to the next worker, and none left stops training naming them.
        rollout_server_token (`str` or `None`, defaults to `None`): the workers' bearer token (default:
            `$TRL_DANCE_ROLLOUT_TOKEN`).
        rollout_audit_transitions (`int`, defaults to `1`), rollout_audit_tolerance (`float` or `None`, defaults to
            `None`): see `rollout_server_urls`.
    """

    max_staleness: int = field(
        default=0, metadata={"help": "Rounds a rollout may lag the trained weights (0: synchronous rounds)."}
    )
    importance_sampling_correction: bool = field(
        default=True, metadata={"help": "GRPO at staleness > 0: decoupled PPO against the round-start weights."}
    )
    importance_sampling_mode: str = field(
        default="truncate", metadata={"help": "truncate | mask.", "choices": list(IS_MODES)}
    )
    importance_sampling_clip_max: float = field(default=2.0, metadata={"help": "Upper bound of the IS weight."})
    importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound of the IS weight (None: 0)."}
    )

    rollout_server_urls: list[str] | None = field(
        default=None, metadata={"help": "trl-dance serve-rollouts workers that sample the rounds (None: in process)."}
    )
    rollout_server_timeout: float = field(default=240.0, metadata={"help": "Seconds to wait for every worker."})
    rollout_request_timeout: float = field(default=600.0, metadata={"help": "Seconds per worker request."})
    rollout_server_token: str | None = field(
        default=None, metadata={"help": "The workers' bearer token (default: $TRL_DANCE_ROLLOUT_TOKEN)."}
    )
    rollout_audit_transitions: int = field(
        default=1, metadata={"help": "Stored transitions of each worker chunk recomputed by the trainer (0: none)."}
    )
    rollout_audit_tolerance: float | None = field(
        default=None, metadata={"help": "Largest audit deviation, in step stds (None: 1e-3 fp32, 0.1 autocast)."}
    )

    def _check_async_rounds(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.importance_sampling_mode not in IS_MODES:
            raise ValueError(
                f"importance_sampling_mode must be one of {list(IS_MODES)}, got {self.importance_sampling_mode!r}"
            )
        low = self.importance_sampling_clip_min or 0.0
        if not (math.isfinite(self.importance_sampling_clip_max) and 0 <= low < self.importance_sampling_clip_max):
            raise ValueError(
                "importance sampling bounds need 0 <= importance_sampling_clip_min < importance_sampling_clip_max, "
                f"got {self.importance_sampling_clip_min} and {self.importance_sampling_clip_max}"
            )
        if self.rollout_audit_transitions < 0:
            raise ValueError(f"rollout_audit_transitions must be >= 0, got {self.rollout_audit_transitions}")
        if self.rollout_server_urls and not self.reward_worker_thread:
            raise ValueError(
                "rollout_server_urls: the workers' chunks are scored as they arrive, by reward_worker_thread"
            )
        if self.max_staleness and not self.reward_worker_thread:
            raise ValueError(
                f"max_staleness={self.max_staleness} scores each round in the background while later rounds run: it "
                "needs reward_worker_thread=True"
            )


@dataclass
class RoundRecord:
    """One launched round of this process: what its rollout produced, with the rewards still being scored.

    ``round`` is its index j, ``version`` the trained rounds of the weights that sampled it; ``scores`` holds one
    (chunk, F) tensor or future per rollout chunk; the rest are the rollout's tensors and the conditioning table
    (see :meth:`RolloutTrainer.sample`)."""

    round: int
    version: int
    rows: list[dict[str, Any]]
    plan: RolloutPlan
    cond: dict[str, torch.Tensor]
    rollout: dict[str, Any]
    scores: list[torch.Tensor | Future]
    calls: int
    reward_seconds: list[float] = field(default_factory=list)  # each chunk's scoring time, appended by the worker
    chunks: list[Future] = field(default_factory=list)  # rollout workers' chunks: (rollout, answer, rewards) each
    answers: list[dict[str, Any]] = field(default_factory=list)  # their verified answers (worker, version, hash)
    audited: bool = False

    @property
    def staleness(self) -> int:
        return self.round - self.version

    def wait(self) -> torch.Tensor:
        """(B, F) rewards, waiting for the chunks still being sampled or scored (a reward's or a worker's error
        surfaces here)."""
        if self.chunks:  # the rollout arrives from the workers, chunk by chunk, in order
            parts = [chunk.result() for chunk in self.chunks]
            self.chunks = []
            self.rollout = {key: torch.cat([part[0][key] for part in parts]) for key in parts[0][0]}
            self.calls = sum(answer["denoiser_calls"] for _, answer, _ in parts)
            self.answers = [answer | {"count": len(scores)} for _, answer, scores in parts]
            self.scores = [scores for _, _, scores in parts]
        self.scores = [score.result() if isinstance(score, Future) else score for score in self.scores]
        return torch.cat(self.scores)

    def state_dict(self) -> dict[str, Any]:
        """Tensors, lists and numbers only (checkpoints load with ``weights_only``); ``rows`` are recomputed from the
        round index on load. Waits for the rewards."""
        rewards = self.wait()
        return {
            "round": self.round,
            "version": self.version,
            "cond": self.cond,
            "rollout": self.rollout,
            "rewards": rewards,
            "calls": self.calls,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], rows: list[dict[str, Any]], plan: RolloutPlan) -> RoundRecord:
        """The record :meth:`state_dict` saved, with its ``rows`` and ``plan`` recomputed from its round index."""
        record = cls(
            state["round"],
            state["version"],
            rows,
            plan,
            state["cond"],
            state["rollout"],
            [state["rewards"]],
            state["calls"],
        )
        record.audited = True  # (before it was saved)
        return record


class RoundRows:
    """This process's rows of any round j, drawn ahead from the train sampler's order: the same
    :class:`EpochSeededRepeatSampler` the data loader reads (epoch ``j // rounds_per_epoch``, each prompt
    ``num_generations`` times), sliced to data-parallel rank ``rank``'s ``batch`` rows. The trainer checks them
    against the data loader's rows when it consumes the round."""

    def __init__(
        self, dataset: Dataset, num_generations: int, prompts_per_round: int, seed: int, rank: int, batch: int
    ):
        self.dataset, self.num_generations, self.prompts_per_round = dataset, num_generations, prompts_per_round
        self.seed, self.rank, self.batch = seed, rank, batch
        self.rounds_per_epoch = len(dataset) // prompts_per_round
        self._orders: dict[int, list[int]] = {}

    def __call__(self, round_index: int) -> list[dict[str, Any]]:
        from .diffusion_trainer import EpochSeededRepeatSampler  # (configs import this module: keep them light)

        epoch, position = divmod(round_index, self.rounds_per_epoch)
        if epoch not in self._orders:
            self._orders = {
                epoch: list(
                    EpochSeededRepeatSampler(
                        self.dataset,
                        mini_repeat_count=self.num_generations,
                        batch_size=self.prompts_per_round,
                        repeat_count=1,
                        shuffle=True,
                        seed=self.seed,
                        epoch=epoch,
                    )
                )
            }
        size = self.prompts_per_round * self.num_generations
        indices = self._orders[epoch][position * size : (position + 1) * size]
        return [self.dataset[i] for i in indices[self.rank * self.batch : (self.rank + 1) * self.batch]]


def rounds_in_run(max_steps: int, updates_per_round: int) -> int:
    """Rounds a run of ``max_steps`` optimizer updates consumes (launches past the last one would be wasted)."""
    return -(-max_steps // updates_per_round)


__all__ = ["AsyncRoundsArguments", "RoundRecord", "RoundRows", "rounds_in_run"]
