"""DiffusionNFT: online RL on the forward process, from deterministic rollouts and their clean samples."""

from __future__ import annotations

from typing import Any

import torch

from ..forward_process import per_sample
from ..losses import (
    art_guidance,
    art_loss,
    art_tilt_scale,
    awm_log_ratio,
    clipped_fraction,
    clipped_surrogate,
    dgpo_loss,
    flow_matching_error,
    nft_loss,
    optimality_probability,
)
from ..policies import DiffusionPolicy, require_flow
from ..sampling import RolloutPlan, mix_seed, seeded_noise
from .diffusion_nft_config import DiffusionNFTConfig
from .evaluation import policy_with
from .old_policy import OldPolicy, nft_decay
from .rollout_trainer import RolloutTrainer


class DiffusionNFTTrainer(RolloutTrainer):
    """DiffusionNFT (Zheng et al., arXiv:2509.16117), with AWM and DGPO as ``loss_type``, on TRL's Trainer machinery.

    Each round, the *old* policy (a soft-updated copy of the trained parameters, see
    :class:`~trl_dance.trainer.old_policy.OldPolicy`) samples ``generation_batch_size`` images with a deterministic
    solver (no SDE, no log-probabilities; no CFG by default) and only each sample's final latent x0 is kept. Rewards
    become group advantages as in GRPO and then optimality probabilities r = clip(½ + A/(2·adv_clip_max), 0, 1). Each
    sample is re-noised with fresh noise to K noise levels of the rollout grid, x_σ = (1 − σ)·x0 + σ·ε, and the loss
    (:func:`~trl_dance.losses.nft_loss`) moves the implicit positive policy toward x0 in proportion to r and the
    implicit negative one in proportion to 1 − r. After the round's updates the old policy moves toward the trained
    one (``old_policy_decay``). ``loss_type="awm"`` and ``"dgpo"`` replace that loss on the same items;
    ``loss_type="art"`` (DiffusionART) instead regresses on the states the ODE rollout visited, toward targets frozen
    from the rollout's own predictions (see :class:`~trl_dance.DiffusionNFTConfig`).

    Flow-matching pipelines (FLUX, SD3, Wan text-to-video and Wan 2.1 image-to-video). The arguments are those of
    :class:`~trl_dance.trainer.rollout_trainer.RolloutTrainer`.
    """

    _tag_names = ["trl", "trl-dance", "diffusion-nft", "diffusers"]
    _name = "DiffusionNFT"
    _paper = {
        "title": "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
        "id": "2509.16117",
        "citation": "@article{zheng2025diffusionnft,\n  title={DiffusionNFT: Online Diffusion Reinforcement with Forward "
        "Process},\n  author={Zheng, Kaiwen and others},\n  journal={arXiv preprint arXiv:2509.16117},\n  year={2025}\n}",
    }
    config_class = DiffusionNFTConfig
    # The loss sees clean samples, their advantages and fresh forward-process noise, never the sampling policy's
    # likelihood: a stale round needs no correction (its samples lag, as the old policy's decay makes them by design).
    supports_async_rounds = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.parameter_sharding is not None:
            raise ValueError(
                f"DiffusionNFTTrainer keeps an old copy of the trained parameters, which {self.parameter_sharding} "
                "shards: use DeepSpeed ZeRO-2 (--accelerate_config zero2) or DDP"
            )
        self.old_policy = OldPolicy(self.policy.denoiser)
        args = self.args
        # AWM's EMA regulariser and DGPO's clip share one fast EMA of the trained weights.
        self.fast_ema = OldPolicy(self.policy.denoiser) if args.ema_kl_beta > 0 or args.dgpo_clip > 0 else None
        self._synced_step = 0  # the optimizer step the old policy / fast EMA were last moved at
        self._train_policy = policy_with(self.policy, guidance_scale=args.train_guidance_scale or args.guidance_scale)
        # MeanFlowNFT's (t, r) pairs on flow-map checkpoints (other losses read the instantaneous velocity, r = t).
        self._flow_map = bool(getattr(self.policy, "flow_map", False)) and args.loss_type == "nft"

    def _check_policy(self, policy: DiffusionPolicy, args: DiffusionNFTConfig) -> None:
        name = type(policy.pipeline).__name__
        hint = ": use DanceGRPOTrainer or DiffusionDPOTrainer"
        self.process = require_flow(policy.process, f"DiffusionNFT (velocity predictions; {name})", hint)
        if getattr(policy, "_first_frame_given", False):
            raise ValueError(
                f"{name} gives the first latent frame (Wan 2.2 TI2V image-to-video); the forward-process loss would "
                "train it: not supported yet"
            )
        levels = policy.trained_denoiser_steps()
        if args.timestep_selection == "stratified":  # AWM: neither σ = 1 nor the last tenth of the grid
            levels = [level for level in levels if 1 <= level <= int(0.9 * policy.num_steps)]
        self._levels = torch.tensor(levels)
        if args.timesteps_per_sample > len(levels):
            raise ValueError(
                f"timestep_fraction {args.timestep_fraction} trains {args.timesteps_per_sample} noise levels per "
                f"sample, but {args.timestep_selection!r} selection has {len(levels)} of the {policy.num_steps} "
                f"({levels}): lower timestep_fraction"
            )

    def _routing_refusal(self, args: DiffusionNFTConfig) -> str | None:
        if args.loss_type != "nft":
            return f"loss_type {args.loss_type!r} has one advantage per sample; loss_type 'nft' routes (OmniNFT)"
        return None

    @staticmethod
    def _needs_reference(args: DiffusionNFTConfig) -> bool:
        return args.beta > 0 or args.loss_type == "dgpo"

    # ----------------------------------------------------------------------------------------------------------
    # Rounds

    def rollout_plan(self, round_index: int | None = None) -> RolloutPlan:
        steps = self.policy.num_steps
        if self.args.loss_type == "art":  # the states ART may train at, and the rollout's predictions there
            return RolloutPlan.deterministic(steps, recorded_steps=tuple(self._art_levels().tolist()))
        if self.args.rollout_solver == "ode":
            return RolloutPlan.deterministic(steps)
        return RolloutPlan.deterministic(
            steps, post_window_sigmas=self.process.sigma_values, post_window_solver="dpm_solver++"
        )

    def _rollout_model(self) -> torch.nn.Module:
        return self.old_policy.model

    def _rollout_weights(self) -> dict[str, torch.Tensor]:
        return self.old_policy.params

    def _generate_and_score(self, rows: list[dict[str, Any]]) -> None:
        if self._generation_round > 0:  # after the previous round's updates
            self._sync_old_policies(round_start=True)
        super()._generate_and_score(rows)

    def _sync_old_policies(self, round_start: bool = False) -> None:
        """Move the old policy and the fast EMA after each optimizer update (host integers only: no device read). The
        old policy moves per update (NFT, ``old_policy_update="step"``) or per round (``"round"``; AWM)."""
        args, step = self.args, self.state.global_step
        if step == self._synced_step and not round_start:
            return
        per_step = args.old_policy_update == "step" and args.loss_type == "nft"
        if round_start or (per_step and step > self._synced_step):
            decay = nft_decay(step, args.old_policy_decay)
            self.old_policy.update(decay)
            self._metrics["old_policy/decay"].append(torch.tensor(decay))
        if self.fast_ema is not None and step > self._synced_step:
            self.fast_ema.update(min(0.3, 0.001 * step))  # AWM's EMA; DGPO's fast "old" model
        self._synced_step = step

    def _art_levels(self) -> torch.Tensor:
        """The grid indices ART's rollouts record: the first K trained levels (ART-Flash), or all of them."""
        return (
            self._levels[: self.args.timesteps_per_sample] if self.args.timestep_selection == "first" else self._levels
        )

    def _plan_round(self, rollout: dict[str, torch.Tensor], plan: RolloutPlan, advantages: torch.Tensor) -> list:
        """Items (sample, grid index, noise seed): K distinct levels per sample and fresh noise in every iteration. For
        DGPO a whole group shares each level and noise, and micro-batches hold whole groups (consecutive rows)."""
        args = self.args
        self._rollout["x0"] = rollout["final_latents"]
        if args.loss_type == "art":
            return self._plan_art_round(rollout, advantages)
        levels = self._levels  # the grid σ the items are noised to
        # The unit drawn: a sample, or for DGPO a group (which every process holds whole).
        group = args.num_generations if args.loss_type == "dgpo" else 1
        units, k = len(advantages) // group, args.timesteps_per_sample
        members = torch.arange(group)
        items = []
        for _ in range(args.num_iterations):
            draws = self._draw_levels(units, k).flatten()
            seeds = torch.randint(2**62, (units * k,), generator=self._cpu_generator)
            order = torch.randperm(units * k, generator=self._cpu_generator)
            unit = torch.arange(units).repeat_interleave(k)[order]
            samples = (unit[:, None] * group + members).flatten()
            chosen = levels[draws[order]].repeat_interleave(group)
            noise = seeds[order].repeat_interleave(group)
            size = args.per_device_train_batch_size
            # Seeds as host integers: a micro-batch draws its noise without reading a tensor.
            items.extend(zip(samples.split(size), chosen.split(size), (c.tolist() for c in noise.split(size))))
        return items

    def _plan_art_round(self, rollout: dict[str, torch.Tensor], advantages: torch.Tensor) -> list:
        """ART's items (samples, recorded positions): K recorded states per sample; window w of ``art_update_windows``
        holds the w-th part of every group's members, shuffled within the window, so that its micro-batches make its
        own optimizer updates (the config makes the updates split the round at window boundaries)."""
        args, size, k = self.args, self.args.per_device_train_batch_size, self.args.timesteps_per_sample
        group, windows = args.num_generations, args.art_update_windows
        guidance = art_guidance(rollout["final_latents"], advantages, group)  # (groups, ...)
        self._rollout |= {
            "visited": rollout["visited"],
            "visited_clean": rollout["visited_clean"],
            "guidance": guidance,
        }
        window = torch.arange(len(advantages)) % group * windows // group
        items = []
        for _ in range(args.num_iterations):
            for w in range(windows):
                rows = (window == w).nonzero().flatten()
                positions = self._draw_levels(len(rows), k).flatten()  # indices into the recorded levels
                order = torch.randperm(len(positions), generator=self._cpu_generator)
                samples = rows.repeat_interleave(k)[order]
                items.extend(zip(samples.split(size), positions[order].split(size)))
        return items

    def _draw_levels(self, units: int, k: int) -> torch.Tensor:
        """(units, k) indices into ``self._levels``: K distinct at random, one per stratum, or the first K."""
        count, generator = len(self._levels), self._cpu_generator
        if self.args.timestep_selection == "first":
            return torch.arange(k).expand(units, k)
        if self.args.timestep_selection == "stratified":
            strata = torch.arange(count).tensor_split(k)
            offsets = torch.tensor([s[0] for s in strata])
            sizes = torch.tensor([len(s) for s in strata])
            return offsets + (torch.rand(units, k, generator=generator) * sizes).long()
        return torch.rand(units, count, generator=generator).argsort(dim=1)[:, :k]

    def _microbatch(self, item: tuple) -> dict[str, Any]:
        if self.args.loss_type == "art":
            return self._art_microbatch(*item)
        rollout, device = self._rollout, self.accelerator.device
        samples, levels, seeds = item
        x0 = rollout["x0"][samples.to(device)]
        noise = seeded_noise(seeds, x0)
        sigma = self.process.sigmas[levels].to(device)
        inputs = {
            "noisy": self.process.add_noise(x0, noise, sigma),
            "noise": noise,
            "groups": torch.arange(len(seeds), device=device) // self.args.num_generations,  # DGPO: whole groups
            "x0": x0,
            "sigma": sigma,
            "advantages": rollout["advantages"][samples.to(device)],
            "cond": self._round_cond(samples.to(device)),
        }
        if self._flow_map:
            ends = self._flow_map_ends(self.process.sigmas[levels], seeds)
            inputs["cond"]["flow_map_end"] = ends.to(device)
            inputs["jump_rows"] = (ends < self.process.sigmas[levels]).nonzero().flatten()  # host: r < t
        return inputs

    def _flow_map_ends(self, sigma: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """MeanFlowNFT's end times r (B,) σ, host, for items at noise levels ``sigma`` (host): r = t with probability
        ``flow_map_diffusion_ratio``, 0 with ``flow_map_consistency_ratio``, else U(0, t); drawn from each item's seed
        (reproducible on resume)."""
        args, ends = self.args, []
        for t, seed in zip(sigma.tolist(), seeds):
            u, v = torch.rand(2, generator=torch.Generator().manual_seed(mix_seed(seed, 0xF10))).tolist()
            if u < args.flow_map_diffusion_ratio:
                ends.append(t)
            else:
                ends.append(0.0 if u < args.flow_map_diffusion_ratio + args.flow_map_consistency_ratio else t * v)
        return torch.tensor(ends, dtype=torch.float32)

    @torch.no_grad()
    def _flow_map_correction(self, inputs: dict[str, Any]) -> torch.Tensor:
        """(t − r)·dF/dt (B, ...) float32: MeanFlowNFT's term taking a flow map u(x_t, r, t) to the instantaneous
        velocity it induces, dF/dt the old policy's central difference along the conditional path x_t' = x_t + (t' −
        t)·(ε − x0) over [max(t − ε_cd, r), min(t + ε_cd, 1)]; 0 on items with r = t (no forward for them)."""
        noisy, sigma, cond = inputs["noisy"], inputs["sigma"], inputs["cond"]
        correction = torch.zeros_like(noisy, dtype=torch.float32)
        rows = inputs["jump_rows"].to(noisy.device)
        if not len(rows):
            return correction
        x, t, end = noisy[rows].float(), sigma[rows], cond["flow_map_end"][rows]
        direction = (inputs["noise"][rows] - inputs["x0"][rows]).float()
        eps, part = self.args.flow_map_cd_epsilon, {key: value[rows] for key, value in cond.items()}
        high, low = (t + eps).clamp(max=1.0), torch.maximum(t - eps, end)
        model, policy = self.old_policy.model, self._train_policy
        plus = policy.predict(model, x + per_sample(high - t, x) * direction, part, at=high)
        minus = policy.predict(model, x + per_sample(low - t, x) * direction, part, at=low)
        correction[rows] = per_sample(t - end, x) * (plus - minus) / per_sample(high - low, x)
        return correction

    def _art_microbatch(self, samples: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        """Visited states and their frozen targets x̂0_old + η·λ(σ)·G(c)."""
        rollout, device, args = self._rollout, self.accelerator.device, self.args
        rows, positions = samples.to(device), positions.to(device)
        sigma = self.process.sigmas[self._art_levels().to(device)[positions]].to(device)
        guidance = rollout["guidance"][rows // args.num_generations]
        shift = args.art_step_size * per_sample(art_tilt_scale(sigma), guidance) * guidance
        return {
            "noisy": rollout["visited"][rows, positions],
            "target": rollout["visited_clean"][rows, positions] + shift,
            "rollout_clean": rollout["visited_clean"][rows, positions],
            "sigma": sigma,
            "advantages": rollout["advantages"][rows],
            "cond": self._round_cond(rows),
        }

    # ----------------------------------------------------------------------------------------------------------
    # Loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, policy = self.args, self._train_policy
        self._sync_old_policies()
        noisy, sigma, cond, x0 = inputs["noisy"], inputs["sigma"], inputs["cond"], inputs.get("x0")  # (ART: no x0)
        advantages = inputs["advantages"]
        velocity = policy.predict(model, noisy, cond, at=sigma)
        dims = tuple(range(1, velocity.ndim))
        reference = None
        if self._needs_reference(args):
            reference = self.reference_prediction(model, noisy, cond, sigma, policy)
        with torch.no_grad():
            ema = None if self.fast_ema is None else policy.predict(self.fast_ema.model, noisy, cond, at=sigma)
        if args.loss_type == "art":
            per_item = art_loss(velocity, noisy, sigma, inputs["target"])
            with torch.no_grad():  # how far θ's clean prediction moved from the rollout's (the frozen policy's)
                clean = noisy.float() - per_sample(sigma, velocity.float()) * velocity.detach().float()
                self._record("old_policy/deviation", ((clean - inputs["rollout_clean"]) ** 2).mean(dim=dims))
        elif args.loss_type == "dgpo":
            error = flow_matching_error(velocity, inputs["noise"], x0)
            reference_error = flow_matching_error(reference, inputs["noise"], x0)
            old_error = None if ema is None else flow_matching_error(ema, inputs["noise"], x0)
            groups = len(sigma) // args.num_generations
            per_item = dgpo_loss(
                error, reference_error, advantages, inputs["groups"], groups, args.dgpo_beta, old_error, args.dgpo_clip
            )
        else:
            with torch.no_grad():
                old_velocity = policy.predict(self.old_policy.model, noisy, cond, at=sigma)
                self._record("old_policy/deviation", ((velocity - old_velocity) ** 2).mean(dim=dims))
            if args.loss_type == "nft":
                r = optimality_probability(advantages, args.adv_clip_max)
                induced, old_induced = velocity, old_velocity
                if self._flow_map:  # NFT on the induced instantaneous velocities (V_θ − V_old = u_θ − u_old)
                    correction = self._flow_map_correction(inputs)
                    induced, old_induced = velocity + correction, old_velocity + correction
                routes = self.reward_routes  # (S, F): each stream's own r; a stream no reward judges is not trained
                per_item = nft_loss(
                    induced, old_induced, noisy, x0, sigma, r, args.nft_beta, args.adv_clip_max,
                    segments=None if routes is None else tuple(policy.streams.values()),
                    stream_weights=None if routes is None else routes.any(dim=1).float(),
                )  # fmt: skip
                self._record("optimality_probability/mean", r)
            else:
                error = flow_matching_error(velocity, inputs["noise"], x0)
                old_error = flow_matching_error(old_velocity, inputs["noise"], x0)
                log_ratio = awm_log_ratio(error, old_error, sigma, args.awm_weighting, args.awm_ghuber_power)
                ratio = torch.exp(log_ratio)
                scaled = advantages / args.adv_clip_max  # AWM's advantage_max 1
                per_item = clipped_surrogate(ratio, scaled, args.epsilon)
                self._record("clip_ratio/region_mean", clipped_fraction(ratio.detach(), scaled, args.epsilon))
        if args.beta > 0:
            kl = ((velocity - reference) ** 2).mean(dim=dims)
            per_item = per_item + args.beta * kl
            self._record("kl", kl)
        if args.ema_kl_beta > 0:
            ema_kl = ((velocity - ema) ** 2).mean(dim=dims)
            per_item = per_item + args.ema_kl_beta * ema_kl
            self._record("ema_kl", ema_kl)
        loss = per_item.mean()
        return (loss, velocity) if return_outputs else loss

    # ----------------------------------------------------------------------------------------------------------
    # Model card and checkpoints: the old policy travels with them

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        return super()._model_card_details() | {
            "sampling": f"{args.num_inference_steps} deterministic steps ({args.rollout_solver}), guidance "
            f"{args.guidance_scale}, {self._sample_size()}",
            "loss": f"{args.loss_type}, {args.num_generations} generations per prompt, NFT β {args.nft_beta}, KL β "
            f"{args.beta}, {args.timesteps_per_sample} noise levels per sample, old-policy decay {args.old_policy_decay}",
        }

    def _resume_state(self) -> dict[str, Any]:
        state = {"old_policy": self.old_policy.state_dict(), "synced_step": self._synced_step}
        if self.fast_ema is not None:
            state["fast_ema"] = self.fast_ema.state_dict()
        return super()._resume_state() | state

    def _restore_resume_state(self, state: dict[str, Any]) -> None:
        super()._restore_resume_state(state)
        self.old_policy.load_state_dict(state["old_policy"])
        self._synced_step = state.get("synced_step", self.state.global_step)
        if self.fast_ema is not None:
            self.fast_ema.load_state_dict(state["fast_ema"])


__all__ = ["DiffusionNFTTrainer"]
