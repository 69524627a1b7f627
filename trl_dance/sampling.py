"""The one rollout loop of the trainers, driven by a per-step noise plan.

A :class:`RolloutPlan` says which steps of a rollout are stochastic (the SDE window, whose transitions are stored and
trained), which are deterministic (the ODE / DDIM-η=0 step), and how the steps after the window are solved (the
policy's own grid, or a compressed grid with DPM-Solver++(2M), MixGRPO-Flash). Everything every step does is the
policy's (:meth:`~trl_dance.policies.DiffusionPolicy.predict` and ``step``, the process's σ grid); this module only
orders them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .policies import Conditioning, DiffusionPolicy, require_flow
from .sde import flow_dpm_solver_step

PostWindowSolver = Literal["ode", "dpm_solver++"]
WindowSchedule = Literal["random", "progressive"]


def mix_seed(*parts: int) -> int:
    """A deterministic 63-bit seed mixed from integers (the same on every process and run)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (part + 0x9E3779B97F4A7C15 + (value << 6) + (value >> 2))) & 0x7FFFFFFFFFFFFFFF
    return value


def seeded_noise(seeds: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """(len(seeds), *like.shape[1:]) standard normal noise on ``like``'s device, row i drawn on the CPU from ``seeds[i]``
    (host integers): the same rows whatever the batch, device or process."""
    return torch.stack(
        [torch.randn(like.shape[1:], generator=torch.Generator().manual_seed(seed)) for seed in seeds]
    ).to(like.device)


def step_noise(
    plan: RolloutPlan, generators: Sequence[torch.Generator], shape: Sequence[int], groups: Sequence[int] | None = None
) -> torch.Tensor:
    """(N, B, *shape) standard normal noise of every step of every sample (CPU): sample b's from ``generators[b]``, all N
    steps in one draw (whatever the plan makes stochastic), then at the plan's ``group_noise_steps`` one draw per group
    id of ``groups`` (host integers), seeded by (``plan.group_noise_seed``, group, step), shared by its samples."""
    noise = torch.stack([torch.randn((plan.num_steps, *shape), generator=g) for g in generators], dim=1)
    if plan.group_noise_steps:
        if groups is None:
            raise ValueError("the plan shares noise within groups at some steps: the rollout needs the group ids")
        for step in plan.group_noise_steps:
            for group in dict.fromkeys(groups):
                shared = torch.Generator().manual_seed(mix_seed(plan.group_noise_seed, group, step))
                noise[step, [b for b, g in enumerate(groups) if g == group]] = torch.randn(
                    tuple(shape), generator=shared
                )
    return noise


def sample_generators(seed: int, round_index: int, first_index: int, count: int) -> list[torch.Generator]:
    """One CPU generator per sample, seeded by (seed, round, global sample index): a sample's noise depends neither on
    the number of processes nor on how samples are batched."""
    return [torch.Generator().manual_seed(mix_seed(seed, round_index, first_index + j)) for j in range(count)]


def group_generators(
    seed: int, round_index: int, first_index: int, count: int, group_size: int
) -> list[torch.Generator]:
    """One generator per sample seeded by its group (samples ``[k·G, (k+1)·G)``), for noise a group shares."""
    groups = [(first_index + j) // group_size for j in range(count)]
    return [torch.Generator().manual_seed(mix_seed(seed, round_index, -1 - group)) for group in groups]


@dataclass(frozen=True)
class SDEWindow:
    """Where a round's window of ``size`` consecutive SDE steps lies within the steps ``[low, high)``.

    ``"random"``: a uniform start per round, drawn from ``(seed, round)`` (identical on every process). ``"progressive"``
    (MixGRPO): the start advances by ``stride`` every ``every`` rounds from ``low`` and wraps to ``low`` past the last
    position. Both are functions of the round counter, so a resumed run (which restores it) continues exactly.
    """

    size: int
    low: int
    high: int
    schedule: WindowSchedule = "random"
    stride: int = 1
    every: int = 1

    def __post_init__(self):
        if not 1 <= self.size <= self.high - self.low:
            raise ValueError(f"an SDE window of {self.size} steps does not fit in the steps [{self.low}, {self.high})")

    @classmethod
    def within(
        cls,
        trainable: list[int],
        size: int,
        window_range: list[int] | tuple[int, int] | None = None,
        schedule: WindowSchedule = "random",
        stride: int = 1,
        every: int = 1,
    ) -> SDEWindow:
        """A window over ``window_range`` (default: all of ``trainable``), which must consist of trainable steps: the
        steps the trained denoiser serves (two-expert pipelines train one expert's)."""
        low, high = window_range or (trainable[0], trainable[-1] + 1)
        outside = sorted(set(range(low, high)) - set(trainable))
        if outside or high - low < size:
            raise ValueError(
                f"sde_window_range [{low}, {high}) with sde_window_size {size} must lie within the trainable steps "
                f"{trainable} (steps {outside} are not; two-expert pipelines train one expert's steps)"
            )
        return cls(size, low, high, schedule, stride, every)

    @property
    def positions(self) -> int:
        """Number of possible starts."""
        return self.high - self.low - self.size + 1

    def start(self, round_index: int, seed: int) -> int:
        if self.schedule == "random":
            generator = torch.Generator().manual_seed(mix_seed(seed, round_index, -0x5DE))
            return self.low + int(torch.randint(self.positions, (), generator=generator))
        if self.schedule == "progressive":
            return self.low + (round_index // self.every * self.stride) % self.positions
        raise ValueError(f"window schedule must be 'random' or 'progressive', got {self.schedule!r}")

    def group_start(self, round_index: int, seed: int, group: int) -> int:
        """A uniform start for global group ``group`` of round ``round_index`` (Flash-GRPO's iso-temporal windows:
        every member of a group shares it, groups differ), the same on every process."""
        generator = torch.Generator().manual_seed(mix_seed(seed, round_index, group, 0x15E))
        return self.low + int(torch.randint(self.positions, (), generator=generator))


@dataclass(frozen=True)
class RolloutPlan:
    """The noise plan of one rollout of ``num_steps`` steps.

    Steps ``[sde_start, sde_end)`` are the policy's SDE step at its noise level, with log-probability; they and their
    states are what the rollout stores. Every other step is the deterministic step (noise 0), except the last one with
    ``last_step_sde`` (sampled, not stored). With ``post_window_sigmas`` (flow policies) the steps from ``sde_end`` on
    are replaced by ``post_window_solver`` on that σ grid, from ``σ_{sde_end}`` down to 0. The samples of a group draw
    the same noise at ``group_noise_steps`` (seeded by ``group_noise_seed``, the group and the step; RTDMD's untrained
    steps), each its own elsewhere.
    """

    num_steps: int
    sde_start: int = 0
    sde_end: int | None = None
    last_step_sde: bool = False
    post_window_sigmas: tuple[float, ...] | None = None
    post_window_solver: PostWindowSolver = "ode"
    sample_starts: tuple[int, ...] | None = None
    sample_window: int = 0
    recorded_steps: tuple[int, ...] | None = None
    group_noise_steps: tuple[int, ...] | None = None
    group_noise_seed: int = 0

    def __post_init__(self):
        if self.sde_end is None:
            object.__setattr__(self, "sde_end", self.num_steps - 1)
        if not 0 <= self.sde_start <= self.sde_end <= self.num_steps - 1:
            raise ValueError(
                f"SDE steps [{self.sde_start}, {self.sde_end}) must be a part of the first {self.num_steps - 1} steps "
                "(the last step is never trained)"
            )
        if self.sample_starts is not None and (
            self.sample_window < 1 or self.last_step_sde or self.post_window_sigmas is not None
        ):
            raise ValueError("per-sample SDE windows need sample_window >= 1, no last_step_sde and the policy's grid")
        if self.recorded_steps is not None:
            if self.sample_starts is not None or self.post_window_sigmas is not None:
                raise ValueError("recorded steps need the policy's grid and a window shared by the batch")
            if not all(0 <= i < self.num_steps for i in self.recorded_steps):
                raise ValueError(f"recorded steps {self.recorded_steps} must be among the {self.num_steps} steps")
        if self.group_noise_steps is not None and not all(0 <= i < self.num_steps for i in self.group_noise_steps):
            raise ValueError(f"group noise steps {self.group_noise_steps} must be among the {self.num_steps} steps")

    @classmethod
    def staggered(cls, num_steps: int, starts: Sequence[int], window: int) -> RolloutPlan:
        """Sample ``b`` steps stochastically on ``[starts[b], starts[b] + window)`` and deterministically elsewhere
        (Flash-GRPO's iso-temporal windows: one position per group); stores ``window + 1`` states per sample."""
        return cls(num_steps, min(starts), max(starts) + window, sample_starts=tuple(starts), sample_window=window)

    def to_dict(self) -> dict:
        """The plan as JSON values (what a rollout worker receives)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> RolloutPlan:
        """The plan :meth:`to_dict` wrote (JSON lists back to tuples)."""
        keys = ("post_window_sigmas", "sample_starts", "recorded_steps", "group_noise_steps")
        tuples = {key: tuple(values[key]) for key in keys if values.get(key)}
        return cls(**(values | tuples))

    def part(self, rows: slice) -> RolloutPlan:
        """The plan of the samples ``rows`` of the batch it was made for (per-sample windows are sliced)."""
        if self.sample_starts is None:
            return self
        return dataclasses.replace(self, sample_starts=self.sample_starts[rows])

    def starts(self, batch: int) -> torch.Tensor:
        """(batch,) long: the first stored step of each sample (host)."""
        if self.sample_starts is None:
            return torch.full((batch,), self.sde_start, dtype=torch.long)
        return torch.tensor(self.sample_starts, dtype=torch.long)

    @classmethod
    def deterministic(cls, num_steps: int, **kwargs) -> RolloutPlan:
        """No stochastic step: the ODE (or DDIM η=0) all the way, e.g. for evaluation or forward-process methods."""
        return cls(num_steps, 0, 0, **kwargs)

    @property
    def stored_steps(self) -> range:
        """Indices of the stored (stochastic, trainable) steps."""
        return range(self.sde_start, self.sde_end)


def compressed_steps(remaining: int, ratio: float) -> int:
    """MixGRPO-Flash's step count for the ``remaining`` steps after the window: ``max(1, ⌊ratio · remaining⌋)``."""
    return max(1, math.floor(ratio * remaining + 1e-9))


def _representatives(groups: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """First index of each distinct group id (in order of appearance) and each sample's position among them."""
    first: dict[int, int] = {}
    for index, group in enumerate(groups):
        first.setdefault(group, index)
    order = list(first)
    return torch.tensor(list(first.values())), torch.tensor([order.index(group) for group in groups])


@torch.no_grad()
def rollout(
    policy: DiffusionPolicy,
    model: torch.nn.Module,
    latents: torch.Tensor,
    cond: Conditioning,
    noise: torch.Tensor,
    plan: RolloutPlan,
    groups: Sequence[int] | None = None,
    keep_means: bool = False,
    grad_steps: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | int | list]:
    """Denoise a batch along ``plan``.

    Args:
        policy: the model family's adapter.
        model: the trained denoiser (possibly wrapped).
        latents: (B, ...) float32 starting latents.
        cond: conditioning of each of the B samples.
        noise: (N, B, ...) standard normal noise of every step of every sample (a step that is deterministic ignores
            its noise, so a sample's stochastic steps get the same noise whatever the plan).
        groups: B group ids (host integers). Samples of a group must share their starting latents and conditioning; the steps
            before ``plan.sde_start`` are then computed once per group (branching), and the group's samples differ
            only from the window on.
        keep_means: also return each stored step's Gaussian mean (GRPO-Guard's ratio normalisation).
        grad_steps: (B, N) bool (host): the stochastic steps of each sample whose denoiser call runs with gradients
            (recompute-free GRPO). Those rows are called apart from the others, with gradients, and their
            log-probability of the step they took is returned differentiable; the latents stay detached.

    Returns:
        ``latents`` (B, S + 1, ...) the states ``sde_start … sde_end`` (S stored steps); ``log_probs`` (B, S) (per
        stream (B, S, streams) with ``policy.runtime.stream_log_probs``);
        ``means`` (B, S, ...) with ``keep_means``; ``final_latents`` (B, ...) the last state; ``denoiser_calls`` the
        number of (sample, step) denoiser evaluations made; with ``grad_steps``, ``grad_log_probs``: a list of
        (rows (n,) host long, step i, log-probabilities (n,) with their graph), one per step with such rows; with
        ``plan.recorded_steps`` (R of them), ``visited`` (B, R, ...) the input state of each and ``visited_clean``
        (B, R, ...) float32 the clean sample x̂0 its prediction implies, in ``recorded_steps``' order.
    """
    if plan.sample_starts is not None:
        if grad_steps is not None:
            raise ValueError("grad_steps needs a window shared by the batch (plan.sample_starts is None)")
        return _staggered_rollout(policy, model, latents, cond, noise, plan, keep_means)
    batch, calls, start = latents.shape[0], 0, 0
    if groups is not None and plan.sde_start > 0:
        reps, inverse = _representatives(groups)
        reps_device = reps.to(latents.device)
        shared = {key: value[reps_device] for key, value in cond.items()}
        prefix = latents[reps_device]
        for i in range(plan.sde_start):
            prefix = ode_step(policy, model, prefix, i, shared)
        calls += len(reps) * plan.sde_start
        latents, start = prefix[inverse.to(latents.device)], plan.sde_start

    stored, log_probs, means, previous, differentiable = [], [], [], None, []
    recorded = dict.fromkeys(plan.recorded_steps or ())
    if any(i < start for i in recorded):
        raise ValueError(f"recorded steps {plan.recorded_steps} precede the shared prefix of the branching rollout")
    end = plan.num_steps if plan.post_window_sigmas is None else plan.sde_end
    for i in range(start, end):
        if i == plan.sde_start:
            stored.append(latents)
        step_index = torch.full((batch,), i, device=latents.device, dtype=torch.long)
        rows = None if grad_steps is None else grad_steps[:, i].nonzero().flatten()
        if rows is None or len(rows) == 0:
            output, graph = policy.predict(model, latents, cond, at=i), None
        else:
            output, graph = _predict_with_grad(policy, model, latents, i, cond, rows)
        calls += batch
        if i in recorded:
            recorded[i] = (latents, policy.process.predicted_clean(output, latents, step_index).float())
        window = plan.sde_start <= i < plan.sde_end
        noisy = window or (i == plan.num_steps - 1 and plan.last_step_sde)
        result = policy.step(
            output, latents, step_index, noise=noise[i], compute_log_prob=window, eta=None if noisy else 0.0
        )
        if graph is not None:
            if not window:
                raise ValueError(f"grad_steps marks step {i}, which the plan makes deterministic")
            # The log-probability of the step taken, as the training loss computes it, differentiable in the model.
            taken = rows.to(latents.device)
            with torch.enable_grad():
                log_prob = policy.step(graph, latents[taken], step_index[taken], prev_sample=result.prev_sample[taken])
            result.log_prob[taken] = log_prob.log_prob.detach()  # what is stored is what is differentiated
            differentiable.append((rows, i, log_prob.log_prob))
        if i == end - 1 and plan.post_window_solver == "dpm_solver++" and plan.post_window_sigmas is not None:
            # DPM-Solver++(2M)'s first step after the window is second order, from this step's x̂0.
            previous = (policy.process.predicted_clean(output, latents, step_index), policy.process.sigma_values[i])
        latents = result.prev_sample
        if window:
            stored.append(latents)
            log_probs.append(result.log_prob)
            if keep_means:
                means.append(result.mean)
    if plan.post_window_sigmas is not None:
        latents = solve(policy, model, latents, cond, plan.post_window_sigmas, plan.post_window_solver, previous)
        calls += batch * (len(plan.post_window_sigmas) - 1)

    out = {"final_latents": latents, "denoiser_calls": calls}
    if grad_steps is not None:
        out["grad_log_probs"] = differentiable
    if recorded:
        out["visited"] = torch.stack([recorded[i][0] for i in plan.recorded_steps], 1)
        out["visited_clean"] = torch.stack([recorded[i][1] for i in plan.recorded_steps], 1)
    if not log_probs:  # a deterministic plan stores nothing
        empty = latents.new_zeros(batch, 0, *latents.shape[1:])
        return (
            out
            | {"latents": empty, "log_probs": latents.new_zeros(batch, 0)}
            | ({"means": empty} if keep_means else {})
        )
    out |= {"latents": torch.stack(stored, 1), "log_probs": torch.stack(log_probs, 1)}
    if keep_means:
        out["means"] = torch.stack(means, 1)
    return out


def _predict_with_grad(
    policy: DiffusionPolicy,
    model: torch.nn.Module,
    latents: torch.Tensor,
    i: int,
    cond: Conditioning,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s prediction of the batch, ``rows`` (host long) called with gradients and the others without:
    (the whole batch's output, detached; the rows' output with its graph)."""
    device = latents.device
    taken = rows.to(device)
    others = torch.ones(len(latents), dtype=torch.bool)
    others[rows] = False
    rest = others.nonzero().flatten().to(device)
    with torch.enable_grad():
        graph = policy.predict(model, latents[taken], {k: v[taken] for k, v in cond.items()}, at=i)
    output = torch.empty((len(latents), *graph.shape[1:]), dtype=graph.dtype, device=device)
    output[taken] = graph.detach()
    if len(rest):
        output[rest] = policy.predict(model, latents[rest], {k: v[rest] for k, v in cond.items()}, at=i)
    return output, graph


def _staggered_rollout(
    policy: DiffusionPolicy,
    model: torch.nn.Module,
    latents: torch.Tensor,
    cond: Conditioning,
    noise: torch.Tensor,
    plan: RolloutPlan,
    keep_means: bool,
) -> dict[str, torch.Tensor | int]:
    """:func:`rollout` with a window per sample (``plan.sample_starts``): every step is computed for the whole batch,
    and the samples inside their window take the SDE step (the same noise as in a shared window), the others the
    deterministic one. Returns the same keys, ``latents`` (B, W + 1, ...) being each sample's own window."""
    batch, window, device = latents.shape[0], plan.sample_window, latents.device
    starts = plan.starts(batch)
    stored = latents.new_zeros(batch, window + 1, *latents.shape[1:])
    streams = (len(policy.streams),) if policy.runtime.stream_log_probs else ()  # per-stream log-probabilities
    log_probs = latents.new_zeros(batch, window, *streams)
    means = latents.new_zeros(batch, window, *latents.shape[1:]) if keep_means else None
    for i in range(plan.num_steps):
        step_index = torch.full((batch,), i, device=device, dtype=torch.long)
        output = policy.predict(model, latents, cond, at=i)
        offset = i - starts  # host: each sample's position in its window
        if (offset == 0).any():
            entering = (offset == 0).nonzero().flatten().to(device)
            stored[entering, 0] = latents[entering]
        following = policy.step(output, latents, step_index, noise=noise[i], compute_log_prob=False, eta=0.0)
        following = following.prev_sample
        inside = ((offset >= 0) & (offset < window)).nonzero().flatten()
        if len(inside):
            rows, slots = inside.to(device), offset[inside].to(device)
            sde = policy.step(output[rows], latents[rows], step_index[rows], noise=noise[i][rows])
            following = following.index_put((rows,), sde.prev_sample)
            stored[rows, slots + 1] = sde.prev_sample
            log_probs[rows, slots] = sde.log_prob
            if keep_means:
                means[rows, slots] = sde.mean
        latents = following
    out = {"final_latents": latents, "denoiser_calls": batch * plan.num_steps, "latents": stored}
    return out | {"log_probs": log_probs} | ({"means": means} if keep_means else {})


def solve(
    policy: DiffusionPolicy,
    model: torch.nn.Module,
    latents: torch.Tensor,
    cond: Conditioning,
    sigmas: tuple[float, ...],
    solver: PostWindowSolver = "ode",
    previous: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Deterministically solve a flow policy from ``sigmas[0]`` down the given σ grid to 0 (MixGRPO-Flash's compressed
    steps after the SDE window; any σ, not only the policy's grid): ``"ode"`` the Euler step, ``"dpm_solver++"``
    DPM-Solver++(2M) (:func:`~trl_dance.sde.flow_dpm_solver_step`), whose first step is second order when ``previous``
    = (x̂0, σ) of the step that reached ``latents`` is given. Returns float32 latents."""
    require_flow(policy.process, "a compressed post-window grid")
    if solver not in ("ode", "dpm_solver++"):
        raise ValueError(f"solver must be 'ode' or 'dpm_solver++', got {solver!r}")
    latents = latents.float()
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        velocity = policy.predict(model, latents, cond, at=float(sigma))
        if solver == "ode":
            latents = latents + (sigma_next - sigma) * velocity
            continue
        x0_hat = latents - sigma * velocity
        latents, previous = flow_dpm_solver_step(x0_hat, latents, sigma, sigma_next, previous), (x0_hat, sigma)
    return latents


def ode_step(
    policy: DiffusionPolicy, model: torch.nn.Module, latents: torch.Tensor, i: int, cond: Conditioning
) -> torch.Tensor:
    """Step ``i`` of the policy's sampler without noise (flow: Euler; DDIM η = 0), differentiable in the model."""
    step_index = torch.full((latents.shape[0],), i, device=latents.device, dtype=torch.long)
    output = policy.predict(model, latents, cond, at=i)
    zeros = torch.zeros_like(latents, dtype=torch.float32)
    return policy.step(output, latents, step_index, noise=zeros, compute_log_prob=False, eta=0.0).prev_sample


__all__ = [
    "RolloutPlan",
    "SDEWindow",
    "StepScorer",
    "compressed_steps",
    "generate",
    "group_generators",
    "mix_seed",
    "ode_step",
    "pooled_rollout",
    "rollout",
    "sample_generators",
    "seeded_noise",
    "solve",
    "step_noise",
]


def generate(
    policy: DiffusionPolicy,
    model: torch.nn.Module,
    generators: list[torch.Generator],
    cond: Conditioning,
    plan: RolloutPlan,
    initial_noise: torch.Tensor | None = None,
    groups: list[int] | None = None,
    keep_means: bool = False,
    decode_audio: bool = False,
    grad_steps: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Denoise B samples along ``plan`` and decode them: :func:`rollout` plus its noise and the images.

    Sample ``b`` draws its initial noise (unless ``initial_noise`` (B, ...) is given) and then the noise of all N
    steps from the CPU generator ``generators[b]``, so it depends neither on the batch it is in nor on which steps the
    plan makes stochastic. Autocast is the caller's. Returns :func:`rollout`'s dict plus ``images`` (B, 3, H, W)
    float32 in [0, 1] (videos: (B, F, 3, H, W)) and, with ``decode_audio`` (policies with ``has_audio``; only rewards
    that score audio need it), ``audio`` (B, channels, samples). ``grad_steps``: see :func:`rollout`.
    """
    with torch.no_grad(), policy.sampling():
        latents = policy.initial_noise(generators) if initial_noise is None else initial_noise
        # (N, B, ...): every step's noise of every sample, moved to the device once.
        noise = step_noise(plan, generators, latents.shape[1:], groups).to(latents.device)
        result = rollout(policy, model, latents, cond, noise, plan, groups, keep_means, grad_steps)
        final = policy.final_latents(result["final_latents"], cond)
        result["images"] = policy.decode(final)
        if decode_audio:
            result["audio"] = policy.decode_audio(final)
    return result


StepScorer = Callable[[list[str], torch.Tensor, torch.Tensor], torch.Tensor]
"""SPO's step-aware scorer: ``(prompts (n), predicted clean images (n, 3, H, W) in [0, 1] (videos (n, F, 3, H, W)),
model timesteps (n,)) -> scores (n,)``."""


@torch.no_grad()
def pooled_rollout(
    policy: DiffusionPolicy,
    model: torch.nn.Module,
    latents: torch.Tensor,
    cond: Conditioning,
    noise: torch.Tensor,
    pool_steps: Sequence[int],
    pool_size: int,
    choices: torch.Tensor,
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor | int]:
    """SPO's rollout: at each step of ``pool_steps``, ``pool_size`` candidates x_{t−1} from each chain's shared x_t,
    scored on their predicted clean latents; the chain continues from candidate ``choices``.

    Every step is the policy's stochastic step (its noise level), except the last, which is deterministic. At a pool
    step the k candidates share x_t's prediction (one Gaussian) and differ in their noise; each candidate's x̂0 comes
    from the prediction at the next step, which the continued candidate then reuses (k denoiser calls per chain and
    pool step). On the last step the candidates are the clean samples themselves.

    Args:
        latents: (B, ...) starting latents; cond: the B chains' conditioning.
        noise: (N, k, B, ...) standard normal noise: candidate j of chain b at step i takes ``noise[i, j, b]`` (the
            steps outside the pools take ``noise[i, 0]``).
        pool_steps: increasing step indices among the first N − 1 (each needs a stochastic step).
        choices: (S, B) long in [0, k), the candidate each chain continues from after each pool step (host tensor).
        score: ``(clean latents (k·B, ...), step indices (k·B,)) -> scores (k·B,)`` (candidate-major: j·B + b), the
            step index being the step whose prediction gave the x̂0 (N for clean samples).

    Returns:
        ``latents`` (B, S, ...) the x_t of each pool; ``candidates`` (B, S, k, ...) its x_{t−1}; ``scores`` (B, S, k);
        ``final_latents`` (B, ...); ``denoiser_calls`` the (sample, step) denoiser evaluations made.
    """
    batch, k, steps = latents.shape[0], pool_size, policy.num_steps
    pools = {step: position for position, step in enumerate(pool_steps)}
    states, candidate_sets, score_sets, calls = [], [], [], 0
    output = None  # the prediction at the current latents, when a pool step already computed it
    for i in range(steps):
        step_index = torch.full((batch,), i, device=latents.device, dtype=torch.long)
        if output is None:
            output = policy.predict(model, latents, cond, at=i)
            calls += batch
        if i not in pools:
            level = 0.0 if i == steps - 1 else None
            latents = policy.step(
                output, latents, step_index, noise=noise[i, 0], compute_log_prob=False, eta=level
            ).prev_sample
            output = None
            continue
        # k candidates from one Gaussian: (k·B, ...), candidate-major.
        repeated = step_index.repeat(k)
        candidates = policy.step(
            output.repeat(k, *[1] * (output.ndim - 1)),
            latents.repeat(k, *[1] * (latents.ndim - 1)),
            repeated,
            noise=noise[i].flatten(0, 1),
            compute_log_prob=False,
        ).prev_sample
        if i + 1 < steps:
            cond_k = {key: value.repeat(k, *[1] * (value.ndim - 1)) for key, value in cond.items()}
            next_output = policy.predict(model, candidates, cond_k, at=i + 1)
            calls += k * batch
            clean = policy.process.predicted_clean(next_output, candidates, repeated + 1)
        else:
            next_output, clean = None, candidates
        scores = score(clean, repeated + 1)
        choice = choices[pools[i]].to(latents.device)
        rows = choice * batch + torch.arange(batch, device=latents.device)
        states.append(latents)
        candidate_sets.append(candidates.view(k, batch, *latents.shape[1:]).transpose(0, 1))
        score_sets.append(scores.view(k, batch).transpose(0, 1))
        latents = candidates[rows]
        output = None if next_output is None else next_output[rows]
    return {
        "latents": torch.stack(states, 1),
        "candidates": torch.stack(candidate_sets, 1),
        "scores": torch.stack(score_sets, 1),
        "final_latents": latents,
        "denoiser_calls": calls,
    }
