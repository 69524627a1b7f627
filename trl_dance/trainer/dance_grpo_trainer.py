"""DanceGRPO: GRPO over the denoising chain of diffusion and rectified-flow models, on TRL's trainer base."""

from __future__ import annotations

from typing import Any

import torch

from ..advantages import extremes_per_group
from ..losses import (
    clipped_fraction,
    clipped_surrogate,
    dppo_surrogate,
    gaussian_step_kl,
    importance_weight,
    normalized_log_ratio,
)
from ..policies import DiffusionPolicy, FlowProcess, StreamFlowProcess
from ..sampling import RolloutPlan, SDEWindow, compressed_steps, mix_seed
from ..sde import join_streams
from .dance_grpo_config import DanceGRPOConfig
from .rollout_trainer import RolloutTrainer


class DanceGRPOTrainer(RolloutTrainer):
    """GRPO for diffusion models (DanceGRPO, arXiv:2505.07818), with TRL's Trainer machinery.

    Each round, every process denoises its share of ``generation_batch_size`` samples with the policy's SDE
    sampler, storing each step's latent and log-probability; rewards are gathered across processes and turned into
    group advantages; a random ``timestep_fraction`` of each trajectory's first N−1 steps become transitions, which
    are shuffled into micro-batches of ``per_device_train_batch_size``. Each ``training_step`` recomputes one
    micro-batch's log-probabilities and takes the PPO-clipped loss, so gradient accumulation, accelerate and
    DeepSpeed work as in any Trainer.

    With ``sde_window_size`` only a window of steps is stochastic, stored and trained (Flow-GRPO-Fast, MixGRPO), the
    others being deterministic (see :mod:`trl_dance.sampling`). The arguments are those of
    :class:`~trl_dance.trainer.rollout_trainer.RolloutTrainer`.
    """

    uses_likelihood_ratio = True
    supports_async_rounds = True  # decoupled PPO corrects for the staleness (importance_sampling_correction)

    _tag_names = ["trl", "trl-dance", "dance-grpo", "diffusers"]
    _name = "DanceGRPO"
    _paper = {
        "title": "DanceGRPO: Unleashing GRPO on Visual Generation",
        "id": "2505.07818",
        "citation": "@article{xue2025dancegrpo,\n  title={DanceGRPO: Unleashing GRPO on Visual Generation},\n"
        "  author={Xue, Zeyue and others},\n  journal={arXiv preprint arXiv:2505.07818},\n  year={2025}\n}",
    }

    config_class = DanceGRPOConfig
    sde_window: SDEWindow | None = None
    _drawn: tuple[torch.Tensor, torch.Tensor] | None = None  # rollout_backprop: the round's transitions, drawn first
    _retained: torch.Tensor | None = None  # rollout_backprop: the round's loss, until its backward
    _proximal: list | None = None  # a stale round's π_prox per micro-batch (decoupled PPO; see _proximal_steps)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.rollout_backprop and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            raise ValueError(
                "rollout_backprop averages the processes' gradients itself after the round's backward, which DeepSpeed "
                "and FSDP own; use DDP (or one process)"
            )

    def _check_policy(self, policy: DiffusionPolicy, args: DanceGRPOConfig) -> None:
        read_sigma = {  # what reads the step's one σ (or Δσ)
            "kl_scaling='flow_grpo' scales the KL by the step's Δσ": args.kl_scaling == "flow_grpo",
            "step_reweighting divides by the step's Δσ": args.step_reweighting,
            "post_window_solver='dpm_solver++' solves on a σ grid": args.post_window_solver != "ode",
            "post_window_step_ratio < 1 builds a compressed σ grid": args.post_window_step_ratio < 1,
        }
        flow_only = read_sigma | {"sde_type='flash' is a rectified-flow SDE": args.sde_type == "flash"}
        for what, used in flow_only.items():
            if used and not isinstance(policy.process, FlowProcess):
                raise ValueError(
                    f"{what}, which {type(policy.pipeline).__name__}'s DDIM steps do not have; flow-matching models only"
                )
        one_sigma = read_sigma | {
            "ratio_normalization (GRPO-Guard) divides by the step's Δσ": args.ratio_normalization,
            "temporal_rectification rescales by the step's gradient scale": args.temporal_rectification,
            "dppo_kl_space='v' rescales by the step's gradient scale": args.trust_region == "dppo"
            and args.dppo_kl_space == "v",
        }
        for what, used in one_sigma.items():
            if used and isinstance(policy.process, StreamFlowProcess):
                raise ValueError(
                    f"{what}, but {type(policy.pipeline).__name__} steps its streams on their own σ grids (no one σ "
                    "per sample)"
                )
        policy.check_schedule()
        trainable = policy.trainable_steps()
        if args.sde_window_size is not None:
            self.sde_window = SDEWindow.within(
                trainable,
                args.sde_window_size,
                args.sde_window_range,
                args.sde_window_schedule,
                args.sde_window_stride,
                args.sde_window_stride_rounds,
            )
        if args.timesteps_per_sample > len(trainable):
            raise ValueError(
                f"timestep_fraction {args.timestep_fraction} trains {args.timesteps_per_sample} of the "
                f"{args.num_inference_steps - 1} steps per sample, but the {args.train_expert} expert serves only "
                f"{len(trainable)} ({trainable}); use timestep_fraction <= {len(trainable) / (args.num_inference_steps - 1):.3f}"
            )
        # g_t = |∂μ/∂output|/std of each trainable step: Flash-GRPO's rectification and DPPO's v-space KL use it
        # (only they: a process with a σ per stream has no one g_t).
        self._gradient_scale = torch.zeros(policy.num_steps)
        if args.temporal_rectification or (args.trust_region == "dppo" and args.dppo_kl_space == "v"):
            self._gradient_scale[trainable] = policy.process.log_prob_gradient_scale(trainable)
        self._rectification = None
        if args.temporal_rectification:  # 1 / each candidate step's gradient scale, averaging 1 over them
            steps = trainable if self.sde_window is None else list(range(self.sde_window.low, self.sde_window.high))
            inverse = 1 / self._gradient_scale[steps]
            self._rectification = torch.zeros(policy.num_steps)
            self._rectification[steps] = inverse / inverse.mean()

    def _keep_means(self) -> bool:
        return self.args.ratio_normalization or self.args.trust_region == "dppo"

    def _routing_refusal(self, args: DanceGRPOConfig) -> str | None:
        # Routed, each stream has its own ratio and advantage: the loss averages the streams' clipped surrogates.
        refusals = {
            "ratio_normalization (GRPO-Guard) normalises one ratio per transition": args.ratio_normalization,
            "trust_region='dppo' masks transitions by one KL": args.trust_region == "dppo",
            "best_of_n_k ranks samples by one advantage": args.best_of_n_k is not None,
        }
        return next((why for why, refused in refusals.items() if refused), None)

    def _branching(self) -> bool:
        return self.args.branching

    def _plan_round(self, rollout: dict[str, torch.Tensor], plan: RolloutPlan, advantages: torch.Tensor) -> list:
        args, batch = self.args, len(advantages)
        starts = plan.starts(batch)  # each sample's first stored step
        self._rollout |= {
            "latents": rollout["latents"],
            "log_probs": rollout["log_probs"],
            "means": rollout.get("means"),
            "first_step": starts.to(self.accelerator.device),
        }
        if self._drawn is not None:  # rollout_backprop drew them before the rollout
            (samples, steps), self._drawn = self._drawn, None
        else:
            trained = torch.arange(batch)
            if args.best_of_n_k is not None:  # the process holds whole groups (checked by the config)
                trained = extremes_per_group(advantages.cpu(), args.num_generations, args.best_of_n_k)
            samples, steps = self._draw_transitions(plan, batch, trained)
        microbatches = self._shuffle(samples, steps)
        self._proximal = None
        if self._round_staleness and args.importance_sampling_correction:
            self._proximal = self._proximal_steps(microbatches)
        if "grad_log_probs" in rollout:
            self._retained = self._retained_loss(rollout["grad_log_probs"], advantages)
        return microbatches

    @torch.no_grad()
    def _proximal_steps(self, microbatches: list) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Decoupled PPO's proximal policy π_prox (the weights at the round's start) at each micro-batch's transitions:
        (log-probability, mean) per micro-batch, from one no-grad forward each; ``None`` for the micro-batches of the
        round's first optimizer update, whose own forward runs with these weights (no extra work)."""
        proximal = [None] * len(microbatches)
        with self.compute_loss_context_manager():
            for position in range(self.args.gradient_accumulation_steps, len(microbatches)):
                inputs = self._transition_inputs(microbatches[position])
                latents, step_index = inputs["latents"], inputs["step_index"]
                output = self.policy.predict(self._rollout_model(), latents, inputs["cond"], at=step_index)
                step = self.policy.step(output, latents, step_index, prev_sample=inputs["next_latents"])
                proximal[position] = (step.log_prob, step.mean)
        return proximal

    def _draw_transitions(
        self, plan: RolloutPlan, batch: int, trained: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample, step) of each of the round's transitions: K of the candidate steps (the first N−1, the trained
        expert's, or its window's; see :meth:`_choose_steps`) of each ``trained`` sample of the ``batch``."""
        if self.sde_window is None:
            candidates = torch.tensor(self.policy.trainable_steps()).expand(batch, -1)
        else:
            candidates = plan.starts(batch)[:, None] + torch.arange(plan.sample_window or self.sde_window.size)
        first_index = self.data_parallel.rank * batch
        groups = (first_index + trained) // self.args.num_generations
        steps = self._choose_steps(candidates[trained], groups)
        return trained.repeat_interleave(self.args.timesteps_per_sample), steps

    def _grad_steps(self, plan: RolloutPlan, batch: int, first_index: int) -> torch.Tensor | None:
        if not self.args.rollout_backprop:
            return None
        self._drawn = self._draw_transitions(plan, batch, torch.arange(batch))
        mask = torch.zeros(batch, self.policy.num_steps, dtype=torch.bool)
        mask[self._drawn] = True
        return mask

    def _retained_loss(self, entries: list, advantages: torch.Tensor) -> torch.Tensor:
        """The round's loss through the rollout's differentiable log-probabilities ``entries`` [(rows, step, log p)],
        as the micro-batches would sum it: each transition's clipped-surrogate term (at ratio 1) over the round's
        transition count, times ``gradient_accumulation_steps`` (which the Trainer divides out)."""
        device = advantages.device
        samples = torch.cat([rows for rows, _, _ in entries]).to(device)
        steps = torch.cat([torch.full((len(rows),), i) for rows, i, _ in entries]).to(device)
        log_prob = torch.cat([log_prob for _, _, log_prob in entries])
        log_ratio = log_prob - log_prob.detach()  # 0: the update starts on-policy; its gradient is ∇log p
        per_transition = self._policy_loss(log_ratio, advantages[samples], steps)
        # Equal micro-batches (the config checks that they divide the round): their mean of means is the mean.
        return per_transition.mean() * self.args.gradient_accumulation_steps

    def _sample_plan(self, plan: RolloutPlan, first_index: int, batch: int, round_index: int) -> RolloutPlan:
        if self.sde_window is None or self.args.timestep_selection != "iso_temporal":
            return plan
        # Flash-GRPO: one window position per group, drawn from (seed, round, group), the same on every process.
        groups = [(first_index + j) // self.args.num_generations for j in range(batch)]
        starts = [self.sde_window.group_start(round_index, self.args.seed, group) for group in groups]
        return RolloutPlan.staggered(plan.num_steps, starts, self.sde_window.size)

    def _log_rollout_metrics(self, all_rewards, total, advantages, plan: RolloutPlan, calls_per_sample: float) -> None:
        super()._log_rollout_metrics(all_rewards, total, advantages, plan, calls_per_sample)
        if self.sde_window is not None:
            starts = plan.sample_starts or (plan.sde_start,)  # per sample (iso-temporal windows) or the round's
            self._metrics["sde_window/start"].append(torch.tensor(sum(starts) / len(starts)))

    def rollout_plan(self, round_index: int | None = None) -> RolloutPlan:
        """The noise plan of round ``round_index`` (default: the next round): every step stochastic, or the round's SDE
        window with deterministic steps around it (and MixGRPO-Flash's compressed grid after it)."""
        args, window = self.args, self.sde_window
        steps = self.policy.num_steps
        if window is None:
            return RolloutPlan(steps, last_step_sde=args.last_step_sde)
        start = window.start(self._generation_round if round_index is None else round_index, args.seed)
        end = start + window.size
        sigmas = None
        if args.post_window_step_ratio < 1 or args.post_window_solver != "ode":
            count = compressed_steps(steps - end, args.post_window_step_ratio)
            sigmas = tuple(self.policy.process.sigma_at(torch.linspace(end, steps, count + 1)).tolist())
        return RolloutPlan(steps, start, end, post_window_sigmas=sigmas, post_window_solver=args.post_window_solver)

    def _choose_steps(self, candidates: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """K steps of each row of ``candidates`` (count, C) (a trained sample of global group ``groups``), flattened:
        drawn independently per sample (``"random"``), per group from (seed, round, group) so that a group's members
        train the same steps (``"iso_temporal"``), or the first / last K."""
        args = self.args
        k, (count, width) = args.timesteps_per_sample, candidates.shape
        if args.timestep_selection == "random":
            draws = torch.rand(count, width, generator=self._cpu_generator).argsort(dim=1)[:, :k]
        elif args.timestep_selection == "iso_temporal":
            seeds = {g: mix_seed(args.seed, self._generation_round, int(g), 0x150) for g in groups.unique().tolist()}
            per_group = {g: torch.rand(width, generator=torch.Generator().manual_seed(s)) for g, s in seeds.items()}
            draws = torch.stack([per_group[int(g)].argsort()[:k] for g in groups])
        else:
            first = 0 if args.timestep_selection == "first" else width - k
            draws = torch.arange(first, first + k).expand(count, k)
        return candidates.gather(1, draws).flatten()

    def _shuffle(self, samples: torch.Tensor, steps: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(sample index, step index) pairs of each micro-batch of the round, a fresh shuffle per iteration."""
        args = self.args
        plan = []
        for _ in range(args.num_iterations):
            order = torch.randperm(samples.numel(), generator=self._cpu_generator)
            plan.extend((samples[c], steps[c]) for c in order.split(args.per_device_train_batch_size))
        return plan

    def _microbatch(self, indices: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = self._transition_inputs(indices)
        if self._proximal is not None:  # a stale round: the clip against π_prox, μ's log-probability for the weight
            proximal = self._proximal[self._step % self.args.round_micro_steps]
            inputs["behaviour_log_prob"] = inputs["old_log_prob"]
            inputs["old_log_prob"], inputs["old_mean"] = proximal if proximal is not None else (None, None)
        return inputs

    def _transition_inputs(self, indices: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A micro-batch's transitions (sample, step) as the loss reads them from the round's rollout."""
        rollout, device = self._rollout, self.accelerator.device
        sample, step = (index.to(device) for index in indices)
        stored = step - rollout["first_step"][sample]  # position among the sample's stored steps
        inputs = {
            "latents": rollout["latents"][sample, stored],
            "next_latents": rollout["latents"][sample, stored + 1],
            "step_index": step,
            "old_log_prob": rollout["log_probs"][sample, stored],
            "advantages": rollout["advantages"][sample],
            "cond": self._round_cond(sample),
        }
        if rollout["means"] is not None:
            inputs["old_mean"] = rollout["means"][sample, stored]
        return inputs

    def _rollout_model(self) -> torch.nn.Module:
        if self.args.rollout_backprop:  # its differentiable calls bypass DDP's forward (gradients averaged below)
            return self.accelerator.unwrap_model(self.model_wrapped)
        return super()._rollout_model()

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.args.rollout_backprop:
            return super().training_step(model, inputs, num_items_in_batch)
        if self._rollout is not None and self._step % self.args.round_micro_steps:
            self._step += 1  # the round's one backward ran at its first micro-step
            return torch.zeros((), device=self.accelerator.device)
        loss = super().training_step(model, inputs, num_items_in_batch)  # the rollout, then the round's backward
        if self.accelerator.num_processes > 1:
            self._average_gradients(model)
        return loss

    def _average_gradients(self, model: torch.nn.Module) -> None:
        """Average the trained parameters' gradients over the processes, as DDP's backward would have: the round's
        backward ran through graphs that DDP's forward did not make."""
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.accelerator.reduce(torch._utils._flatten_dense_tensors(grads), "mean")
        for param, grad in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
            param.grad = grad

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.args.rollout_backprop:  # the round's loss through the rollout's graphs (the first micro-step)
            loss, self._retained = self._retained, None
            return (loss, None) if return_outputs else loss
        latents, step_index = inputs["latents"], inputs["step_index"]
        output = self.policy.predict(model, latents, inputs["cond"], at=step_index)
        step = self.policy.step(output, latents, step_index, prev_sample=inputs["next_latents"])
        behaviour = inputs.get("behaviour_log_prob")  # a stale round, corrected (see _proximal_steps)
        if behaviour is not None and inputs["old_log_prob"] is None:  # the first update: π_prox is this policy
            inputs = inputs | {"old_log_prob": step.log_prob.detach(), "old_mean": step.mean.detach()}

        if self.args.ratio_normalization:
            log_ratio = self._normalized_log_ratio(output, inputs, step)
        else:
            log_ratio = step.log_prob - inputs["old_log_prob"]
        kl_old = None
        if self.args.trust_region == "dppo":
            kl_old = gaussian_step_kl(inputs["old_mean"], step.mean.detach(), step.std)
            if self.args.dppo_kl_space == "v":  # mean((v_θ − v_old)²): the means differ by a_t = g_t·std times it
                kl_old = 2 * kl_old / self._gradient_scale.to(kl_old.device)[step_index] ** 2
        per_transition = self._policy_loss(log_ratio, inputs["advantages"], step_index, kl_old)
        if behaviour is not None:
            per_transition = per_transition * self._behaviour_weight(inputs["old_log_prob"], behaviour)

        if self.args.beta > 0:
            ref_mean = self._reference_mean(model, inputs)
            kl = gaussian_step_kl(step.mean, ref_mean, step.std)
            if self.args.kl_scaling == "flow_grpo" and self.args.sde_type != "cps":  # CPS: std is the step's own
                kl = kl * self._delta_sigma(step_index)
            per_transition = per_transition + self.args.beta * kl
            self._record("kl", kl)
        loss = per_transition.mean()
        return (loss, output) if return_outputs else loss

    def _policy_loss(
        self,
        log_ratio: torch.Tensor,
        advantages: torch.Tensor,
        step_index: torch.Tensor,
        kl_old: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-transition policy loss (n,) of log-ratios ``log_ratio`` (n,) against the rollout (with rewards routed per
        modality, (n, S) and advantages (n, S): the streams' surrogates averaged): the PPO-clipped surrogate
        (or, given the KL to the rollout's step ``kl_old``, DPPO's masked one), GRPO-Guard's step reweighting,
        Flash-GRPO's rectification; records the ratio metrics."""
        ratio = torch.exp(log_ratio)
        eps, eps_high = self.args.epsilon, self.args.epsilon_high
        if kl_old is not None:
            per_transition, keep = dppo_surrogate(ratio, advantages, kl_old, self.args.dppo_kl_threshold)
            self._record("dppo/kl", kl_old)
            self._record("dppo/masked_fraction", 1 - keep)
        else:
            per_transition = clipped_surrogate(ratio, advantages, eps, eps_high)
            if per_transition.ndim == 2:  # rewards routed per modality: the streams' terms (own ratio and advantage),
                per_transition = per_transition.mean(dim=1)  # averaged as OmniNFT averages its streams' losses
        if self.args.step_reweighting:
            per_transition = per_transition / self._delta_sigma(step_index)
        if self._rectification is not None:  # Flash-GRPO: every timestep's gradient on one scale
            per_transition = per_transition * self._rectification.to(per_transition.device)[step_index]
        with torch.no_grad():
            self._record("clip_ratio/region_mean", clipped_fraction(ratio, advantages, eps, eps_high))
            self._record("ratio/mean", ratio)
            self._record("approx_kl", 0.5 * log_ratio**2)
        return per_transition

    def _behaviour_weight(self, proximal: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
        """Decoupled PPO's weight w (n,) of π_prox over the sampling policy μ, from their log-probabilities at the
        transitions (detached); records its statistics, the fraction masked and the k3 estimate of KL(μ ‖ π_prox)."""
        args = self.args
        log_weight = (proximal - behaviour).detach()
        if log_weight.ndim == 2:  # per-stream log-probabilities (routed rewards): the transition's joint one
            log_weight = join_streams(log_weight, tuple(self.policy.streams.values()), args.log_prob_reduction)
        weight, kept = importance_weight(
            log_weight,
            args.importance_sampling_mode,
            args.importance_sampling_clip_max,
            args.importance_sampling_clip_min,
        )
        gathered = self.accelerator.gather(torch.exp(log_weight).float())
        self._metrics["async/is_weight/mean"].append(gathered.mean())
        self._metrics["async/is_weight/min"].append(gathered.min())
        self._metrics["async/is_weight/max"].append(gathered.max())
        self._metrics["async/is_ess"].append(gathered.sum() ** 2 / (len(gathered) * (gathered**2).sum()))
        self._record("async/is_masked_fraction", 1 - kept)
        self._record("async/behaviour_kl", torch.expm1(log_weight) - log_weight)
        return weight

    def _delta_sigma(self, step_index: torch.Tensor) -> torch.Tensor:
        process = self.policy.process  # (a flow process: the config checks refuse Δσ options on others)
        return process.sigma(step_index) - process.sigma(step_index + 1)

    def _normalized_log_ratio(self, output: torch.Tensor, inputs: dict, step) -> torch.Tensor:
        # ℓ(μ) and ℓ(μ_old) under the current Gaussian, through the same step function (same latent elements).
        latents, step_index = inputs["latents"], inputs["step_index"]
        at_old_mean = self.policy.step(output, latents, step_index, prev_sample=inputs["old_mean"]).log_prob
        at_mean = self.policy.step(output, latents, step_index, prev_sample=step.mean).log_prob
        return normalized_log_ratio(step.log_prob, inputs["old_log_prob"], at_old_mean, at_mean, step.std)

    def _reference_mean(self, model, inputs) -> torch.Tensor:
        latents, step_index = inputs["latents"], inputs["step_index"]
        output = self.reference_prediction(model, latents, inputs["cond"], step_index)
        return self.policy.step(
            output, latents, step_index, prev_sample=inputs["next_latents"], compute_log_prob=False
        ).mean

    def _round_state(self) -> dict[str, Any]:
        return super()._round_state() | {"proximal": self._proximal}

    def _restore_round_state(self, state: dict[str, Any]) -> None:
        super()._restore_round_state(state)
        self._proximal = state["proximal"]

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        return super()._model_card_details() | {
            "sampling": f"{args.num_inference_steps} steps, {args.sde_type} SDE, noise level {args.eta}, "
            f"guidance {args.guidance_scale}, {self._sample_size()}",
            "GRPO": f"{args.num_generations} generations per prompt, clip {args.epsilon}, KL β {args.beta}, "
            f"{args.timestep_fraction:.0%} of the steps trained, advantages: {args.scale_rewards}",
            **({"SDE window": self._window_card()} if self.sde_window is not None else {}),
        }

    def _window_card(self) -> str:
        window, args = self.sde_window, self.args
        text = f"{window.size} steps in [{window.low}, {window.high}), {window.schedule}"
        if args.post_window_step_ratio < 1 or args.post_window_solver != "ode":
            text += f"; after it {args.post_window_solver} on {args.post_window_step_ratio:.0%} of the steps"
        return text + (", branched from a shared prefix" if args.branching else "")


__all__ = ["DanceGRPOTrainer"]
