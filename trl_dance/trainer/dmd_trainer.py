"""DMD2 distribution-matching distillation of a few-step student, with RTDMD's reward tilt as an option."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.configuration_utils import FrozenDict

from ..forward_process import per_sample, renoise_interval
from ..lora import add_lora
from ..losses import (
    ambient_velocity_error,
    clipped_fraction,
    clipped_surrogate,
    consistency_loss,
    dmd_loss,
    flow_matching_error,
    gan_discriminator_loss,
    gan_generator_loss,
)
from ..policies import DiffusionPolicy, require_flow
from ..preference_data import fitted_media
from ..rewards import reward_name
from ..sampling import RolloutPlan, mix_seed, seeded_noise
from ..sde import flow_sde_step
from .diffusion_trainer import load_denoiser
from .direct_reward_trainer import checked_score
from .dmd_config import DMDConfig
from .evaluation import policy_with
from .fake_score import FakeScore
from .gan_head import FeatureTap, GANHead
from .rollout_trainer import RolloutTrainer, _columns

logger = logging.getLogger(__name__)


class DMDTrainer(RolloutTrainer):
    """DMD2 (Yin et al., arXiv:2405.14867) on flow-matching models, on TRL's Trainer machinery.

    Each round the student (the trained LoRA, or the denoiser) samples the round's prompts with its own deterministic
    few-step sampler and every state x_k it visits is recorded with its clean prediction. The fake score (a
    :class:`~trl_dance.trainer.fake_score.FakeScore`, its own AdamW) then makes ``fake_score_updates`` flow-matching
    updates on those clean predictions, re-noised to σ ~ U[``dmd_sigma_min``, ``dmd_sigma_max``]; then each sample's
    state at one of its steps k, drawn uniformly (backward simulation: the student is trained on its own intermediate
    states, not on noised data), gives x_g = x_k − σ_k·v_θ(x_k) with gradient, and the generator loss
    (:func:`~trl_dance.losses.dmd_loss`) moves x_g toward the teacher's clean prediction at x_σ = (1 − σ)·sg(x_g) + σ·ε
    and away from the fake score's. The teacher is the base (LoRA disabled; a frozen copy for full fine-tuning) with
    ``teacher_guidance_scale``. With ``reward_tilt`` > 0 (RTDMD), the loss also subtracts that weight times the rewards
    of the decoded x_g, back-propagated through the decoder. With ``gan_generator_weight`` > 0 (DMD2's GAN), a
    classifier head on the fake score's features (:class:`~trl_dance.trainer.gan_head.GANHead`) learns, in the fake
    score's updates, to tell the dataset's real images from the student's samples, and the student's loss adds
    softplus(−D(x_g)). With ``loss_type="ac_dmd"`` (RTDMD's stage 1) the student samples with CPS transitions and is
    judged one level down: its CPS step x_s from the recorded state, re-noised along (σ_s, σ_t], against the teacher's
    and the fake score's CPS steps back to σ_s; the fake score learns that re-noising's velocity and a consistency term.
    With ``loss_type="rtdmd"`` (RTDMD's stage 2) the student also trains by PPO on ``policy_gradient_steps`` of its CPS
    steps with group advantages of the rewards, DMD's loss (``distribution_matching_weight``) at its last step.

    Flow-matching pipelines. The arguments are those of :class:`~trl_dance.trainer.rollout_trainer.RolloutTrainer`;
    ``reward_funcs`` monitor the student's samples (and, with ``reward_tilt``, must be differentiable); and
    ``teacher_model`` (TRL's GKD name): a teacher from another checkpoint — a denoiser of the same class, a pipeline
    holding one, or its Hub id or folder (default ``args.teacher_model_name_or_path``; None: the trained model's
    base); the fake score then starts as that teacher.
    """

    _tag_names = ["trl", "trl-dance", "dmd", "distillation", "diffusers"]
    _name = "DMD"
    _paper = {
        "title": "Improved Distribution Matching Distillation for Fast Image Synthesis",
        "id": "2405.14867",
        "citation": "@inproceedings{yin2024dmd2,\n  title={Improved Distribution Matching Distillation for Fast Image "
        'Synthesis},\n  author={Yin, Tianwei and Gharbi, Micha{\\"e}l and Park, Taesung and Zhang, Richard and '
        "Shechtman, Eli and Durand, Fredo and Freeman, William T.},\n  booktitle={NeurIPS},\n  year={2024}\n}",
    }
    config_class = DMDConfig
    uses_likelihood_ratio = False
    supports_async_rounds = False
    _synchronous_reason = "DMDTrainer trains the student and its fake score on the student's current samples"

    def __init__(self, *args, teacher_model: str | DiffusionPipeline | torch.nn.Module | None = None, **kwargs):
        self._teacher_source = teacher_model  # (resolved while the base class builds the reference)
        super().__init__(*args, **kwargs)
        args = self.args
        if self.parameter_sharding is not None:
            raise ValueError(
                f"DMDTrainer keeps its fake score as a second copy of the trained parameters, which "
                f"{self.parameter_sharding} shards: use DeepSpeed ZeRO-2 (--accelerate_config zero2) or DDP"
            )
        if args.reward_tilt > 0:
            plain = [reward_name(f) for f in self.reward_funcs if not callable(getattr(f, "score", None))]
            if plain:
                raise ValueError(
                    f"reward_tilt back-propagates the rewards through the decoded sample; {plain} only return floats. "
                    "Use rewards with a differentiable score(prompts, images) -> Tensor (the model rewards, brightness)"
                )
        if args.merge_lora and self._teacher_source is None:
            logger.warning(
                "merge_lora with no teacher_model_name_or_path: the teacher is the base with %s merged (the student "
                "this run starts from), not the original model; RTDMD's stage 2 judges against the original: set "
                "teacher_model_name_or_path to it",
                args.merge_lora,
            )
        # The fake score runs on the teacher and starts as it (DMD2's); with the base as teacher, as the student.
        teacher = self.ref_model if self._teacher_source is not None else None
        self.fake_score = FakeScore(
            self.policy.denoiser if teacher is None else teacher,
            args.fake_score_learning_rate,
            args.weight_decay,
            (args.adam_beta1, args.adam_beta2),
            args.adam_epsilon,
            args.max_grad_norm,
            initial=None if teacher is None else self._teacher_tensors(teacher),
        )
        self._teacher_policy = policy_with(
            self.policy, self._teacher_pipeline(), guidance_scale=args.teacher_guidance_scale
        )
        denoiser_config = self.policy.denoiser.config
        if args.teacher_guidance_scale > 1 and not (
            self._teacher_policy.use_cfg or denoiser_config.get("guidance_embeds", False)
        ):
            raise ValueError(
                f"teacher_guidance_scale={args.teacher_guidance_scale} has no effect on "
                f"{type(self.policy.pipeline).__name__}: it runs no CFG (a step-distilled checkpoint) and has no "
                "guidance embedding; set teacher_guidance_scale to 1"
            )
        for name in ("dmd_sigma_max", "fake_score_sigma_max") if args.loss_type == "ac_dmd" else ():
            if not self.process.sigma_values[1] < getattr(args, name):
                raise ValueError(
                    f"AC-DMD re-noises each step's next level σ_s up to σ_t in (σ_s, {name}]: {name} "
                    f"({getattr(args, name)}) must exceed the grid's second level ({self.process.sigma_values[1]:.4f})"
                )
        self.gan_head = self.gan_tap = None
        if args.gan_generator_weight > 0:
            self._real_field = self._check_real_images(args)
            self.gan_tap = FeatureTap(self.fake_score.module, args.gan_feature_block)
            self.gan_head = GANHead(seed=args.seed)

    def _reference_model(self, policy: DiffusionPolicy, args: DMDConfig, peft_config) -> torch.nn.Module | None:
        """A teacher from another checkpoint (``teacher_model``, or ``args.teacher_model_name_or_path``), or None. With
        a LoRA, it gets the student's adapter layout with B zeroed (its own forwards are its base's), for the fake
        score's tensors to take their place; A is drawn as the student's is, from ``args.seed``."""
        if self._teacher_source is None:  # the constructor's argument first, then the config's
            self._teacher_source = args.teacher_model_name_or_path
        source = self._teacher_source
        if source is None:
            return None
        teacher = load_denoiser(source, policy, args, "teacher_model")
        if teacher is policy.denoiser:
            raise ValueError("teacher_model is the trained denoiser itself: leave it unset to distil from its base")
        if peft_config is not None:
            # Seeded: the adapter's random A becomes the fake score's start, and this runs before the Trainer seeds
            # (unseeded, two runs of one seed differed, and ranks whose generators differ would start apart).
            cuda = sorted({p.device.index for p in teacher.parameters() if p.device.type == "cuda"})
            with torch.random.fork_rng(devices=cuda):
                torch.manual_seed(args.seed)
                add_lora(teacher, peft_config)
            with torch.no_grad():
                for name, param in teacher.named_parameters():
                    if ".lora_B." in name:
                        param.zero_()
        return teacher

    def _teacher_pipeline(self) -> DiffusionPipeline:
        """The pipeline the teacher's steps run through: the trained model's, with a teacher checkpoint's own pipeline
        settings where they differ (FLUX.2 [klein]'s ``is_distilled``: a base teacher runs CFG where its step-distilled
        student cannot). A view: the same components, another config."""
        pipeline = self.policy.pipeline
        source = self._teacher_source
        if isinstance(source, str):
            try:
                settings = DiffusionPipeline.load_config(source)
            except OSError:  # a denoiser's folder without a pipeline index: the trained pipeline's settings
                return pipeline
        elif isinstance(source, DiffusionPipeline):
            settings = dict(source.config)
        else:
            return pipeline
        own = {k: v for k, v in settings.items() if not k.startswith("_") and not isinstance(v, (list, tuple))}
        if all(pipeline.config.get(key) == value for key, value in own.items()):
            return pipeline
        view = copy.copy(pipeline)
        view._internal_dict = FrozenDict({**pipeline.config, **own})
        return view

    def _teacher_tensors(self, teacher: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The teacher's tensors at the trained tensors' names (the fake score's start): a ValueError if the two
        architectures differ."""
        params = dict(teacher.named_parameters())
        trained = {name: p for name, p in self.policy.denoiser.named_parameters() if p.requires_grad}
        wrong = [n for n, p in trained.items() if n not in params or params[n].shape != p.shape]
        if wrong:
            raise ValueError(
                f"teacher_model's {type(teacher).__name__} differs from the trained one's configuration: "
                f"{len(wrong)} trained tensors have no counterpart of the same shape in it (first: {wrong[0]!r})"
            )
        return {name: params[name] for name in trained}

    def _check_real_images(self, args: DMDConfig) -> str:
        """The dataset column of the GAN's real images (or videos), checked."""
        if args.context_parallel_size > 1:
            raise ValueError(
                "the GAN head averages its features over a sample's tokens, which context parallelism splits across "
                "processes: train the GAN without context_parallel_size"
            )
        if "audio" in (self.policy.streams or {}):
            raise ValueError(
                f"{type(self.policy.pipeline).__name__} denoises a video and its soundtrack together: the GAN's real "
                "videos would need their audio latents too, which trl-dance does not encode yet"
            )
        columns = _columns(self.train_dataset)
        field = args.dataset_image_field or ("video" if self.policy.is_video and "video" in columns else "image")
        if field not in columns:
            raise ValueError(
                f"gan_generator_weight > 0 needs real images: train_dataset has no column {field!r} (columns: "
                f"{columns}); set dataset_image_field"
            )
        if field in self.policy.condition_columns:
            raise ValueError(
                f"{type(self.policy.pipeline).__name__} conditions every sample on the column {field!r}: give the GAN's "
                "real images another column (dataset_image_field)"
            )
        return field

    def _check_policy(self, policy: DiffusionPolicy, args: DMDConfig) -> None:
        name = type(policy.pipeline).__name__
        self.process = require_flow(policy.process, f"DMD (velocity predictions; {name})", "")
        if getattr(policy, "flow_map", False):
            raise ValueError(
                f"{name} is a flow map (a MeanFlow checkpoint: each step is a jump to the next step's time); DMD's "
                "student loss reads its clean sample from one step's instantaneous velocity: distil a base checkpoint"
            )

    @staticmethod
    def _needs_reference(args: DMDConfig) -> bool:
        return True  # the teacher

    @property
    def _trains_on_advantages(self) -> bool:
        return self.args.loss_type == "rtdmd"

    def _advantages(
        self, all_rewards: torch.Tensor, total: torch.Tensor, prompts: list[str], weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self._trains_on_advantages:  # RTDMD's stage 2: its policy gradient's
            return super()._advantages(all_rewards, total, prompts, weights)
        return torch.zeros_like(total)  # the rewards monitor (or tilt through their gradient): no group statistics

    def _signal_items(self, advantages: torch.Tensor) -> None:
        return None  # every sample trains the student, whatever its reward

    # ----------------------------------------------------------------------------------------------------------
    # Rounds

    def rollout_plan(self, round_index: int | None = None) -> RolloutPlan:
        steps, args = self.policy.num_steps, self.args
        round_index = self._generation_round if round_index is None else round_index
        if args.loss_type == "rtdmd":  # RTDMD's: a group shares its noise at the steps PPO does not train this round
            trained = set(self._policy_gradient_steps(round_index).tolist())
            shared = tuple(i for i in range(steps - 1) if i not in trained)
            seed = mix_seed(args.seed, round_index, 0x6A0)
            return RolloutPlan(
                steps, recorded_steps=tuple(range(steps)), group_noise_steps=shared or None, group_noise_seed=seed
            )
        if args.loss_type == "ac_dmd" or args.backward_simulation == "renoise":
            # CPS transitions (η = 1: DMD2's re-noising); the last, onto σ = 0, is deterministic
            return RolloutPlan(steps, recorded_steps=tuple(range(steps)))
        return RolloutPlan.deterministic(steps, recorded_steps=tuple(range(steps)))

    def _eval_plan(self, policy) -> RolloutPlan:
        if self.args.backward_simulation == "renoise":  # the student is judged with the sampler it trains with
            return RolloutPlan(policy.num_steps)
        return super()._eval_plan(policy)

    def _sampling_record(self) -> dict[str, Any]:
        record = super()._sampling_record()
        if self.args.backward_simulation == "renoise":
            record["stochastic_sampling"] = True
        return record

    def _cps(self, velocity: torch.Tensor, latents: torch.Tensor, sigma, sigma_next, noise: torch.Tensor):
        """AC-DMD's CPS transition (``cps_eta``) from σ to σ' < σ with the given standard normal ``noise`` (B, ...),
        float32 (σ' = 0: the clean prediction)."""
        return flow_sde_step(
            velocity, latents, sigma, sigma_next, sde_type="cps", eta=self.args.cps_eta, noise=noise,
            compute_log_prob=False,
        ).prev_sample  # fmt: skip

    def _sigma_range(self, fake: bool) -> tuple[float, float]:
        """[σ_min, σ_max] of the student's loss, or (``fake``) of the fake score's."""
        args = self.args
        if fake:
            return args.fake_score_sigma_min, args.fake_score_sigma_max
        return args.dmd_sigma_min, args.dmd_sigma_max

    def _above(self, sigma: torch.Tensor, floor: torch.Tensor, fake: bool = False) -> torch.Tensor:
        """σ (B,) drawn in [σ_min, σ_max] mapped affinely onto [max(σ_min, floor), σ_max]: AC-DMD's σ_t above σ_s
        (the identity where σ_s <= σ_min)."""
        least, high = self._sigma_range(fake)
        low = floor.clamp_min(least)
        return low + (sigma - least) / (high - least) * (high - low)

    def _draw(self, count: int, fake: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Per sample: a step index (of the recorded ones; ``"rtdmd"``: the last), a noise level in [σ_min, σ_max] (of
        the student's loss, or ``fake``: of the fake score's) and a noise seed (host)."""
        generator, (low, high) = self._cpu_generator, self._sigma_range(fake)
        steps = torch.randint(self.policy.num_steps, (count,), generator=generator)
        if self.args.loss_type == "rtdmd":
            steps = torch.full_like(steps, self.policy.num_steps - 1)
        sigmas = low + (high - low) * torch.rand(count, generator=generator)
        return steps, sigmas, torch.randint(2**62, (count,), generator=generator).tolist()

    def _consume_round(self, record, rows: list[dict[str, Any]]) -> None:
        self._round_rows = record.rows  # (the GAN's real images are read from them when the round is planned)
        super()._consume_round(record, rows)

    def _plan_round(self, rollout: dict[str, torch.Tensor], plan: RolloutPlan, advantages: torch.Tensor) -> list:
        """The fake score's updates on the round's samples, then the student's items (samples, steps, σ, seeds)."""
        self._rollout |= {"visited": rollout["visited"], "visited_clean": rollout["visited_clean"]}
        if self.gan_head is not None:
            self._rollout["real"] = self._real_latents(self._round_rows)
        for _ in range(self.args.fake_score_updates):
            self._update_fake_score()
        count, size = len(advantages), self.args.per_device_train_batch_size
        if self.args.loss_type == "rtdmd":
            return self._hybrid_items(rollout, plan, count, size)
        order = torch.randperm(count, generator=self._cpu_generator)
        steps, sigmas, seeds = self._draw(count)
        seeds = torch.tensor(seeds)[order]
        return list(zip(order.split(size), steps[order].split(size), sigmas[order].split(size),
                        (s.tolist() for s in seeds.split(size))))  # fmt: skip

    def _hybrid_items(self, rollout: dict[str, torch.Tensor], plan: RolloutPlan, count: int, size: int) -> list:
        """RTDMD's stage-2 items: each sample at its last step (DMD and the tilt) and at each of the round's PPO steps
        (the stochastic steps whose noise the rollout's ``plan`` did not share; their items carry no σ or seed), in
        micro-batches of one kind (each loss has its own forwards, of a fixed batch), in a shuffled order."""
        self._rollout["log_probs"] = rollout["log_probs"]
        shared, generator = plan.group_noise_steps or (), self._cpu_generator
        chosen = torch.tensor([i for i in range(plan.num_steps - 1) if i not in shared])
        steps, sigmas, seeds = self._draw(count)  # (the last step's σ and seed)
        samples = torch.arange(count)
        ppo = torch.cartesian_prod(samples, chosen)[torch.randperm(count * len(chosen), generator=generator)]
        items = [(rows, steps[rows], sigmas[rows], [seeds[i] for i in rows.tolist()])
                 for rows in torch.randperm(count, generator=generator).split(size)]  # fmt: skip
        items += [(pairs[:, 0], pairs[:, 1], None, None) for pairs in ppo.split(size)]
        return [items[i] for i in torch.randperm(len(items), generator=generator).tolist()]

    def _policy_gradient_steps(self, round_index: int) -> torch.Tensor:
        """RTDMD's "SubGRPO": ``policy_gradient_steps`` of the N − 1 stochastic steps (host, sorted), drawn from
        (seed, round): the same for every sample and process."""
        generator = torch.Generator().manual_seed(mix_seed(self.args.seed, round_index, 0x57D))
        draw = torch.randperm(self.policy.num_steps - 1, generator=generator)
        return draw[: self.args.policy_gradient_steps].sort().values

    def _real_latents(self, rows: list[dict[str, Any]]) -> torch.Tensor:
        """The latents (B, ...) of each row's real image (video), fitted to the sampled size; the VAE posterior's
        sample drawn from the trainer's checkpointed host generator."""
        args, policy = self.args, self.policy
        pixels = fitted_media(
            [row[self._real_field] for row in rows],
            args.height,
            args.width,
            args.num_frames if policy.is_video else None,
        )
        generator = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=self._cpu_generator)))
        with torch.no_grad():
            return policy.encode_images(pixels.to(self.accelerator.device), generator)

    def _update_fake_score(self) -> None:
        """One fake-score update: flow matching, at fresh σ and noise, toward each sample's clean prediction at a step
        drawn uniformly (the student's samples, detached), over the round's samples in micro-batches (AC-DMD: the
        velocity of the sub-interval re-noising of the student's CPS step from that state, plus the consistency term);
        with the GAN, plus its classifier's loss on those re-noised samples (the same forward) against the rows' real
        images (re-noised at their own σ and noise)."""
        rollout, device, args = self._rollout, self.accelerator.device, self.args
        clean_table = rollout["visited_clean"]
        count, size = clean_table.shape[0], args.per_device_train_batch_size
        steps, sigmas, seeds = self._draw(count, fake=True)
        gan, ac = self.gan_head is not None, args.loss_type != "dmd"  # (rtdmd: AC-DMD's at the last step)
        if gan:
            _, real_sigmas, real_seeds = self._draw(count, fake=True)
        losses = []
        for start in range(0, count, size):
            part = slice(start, min(start + size, count))
            rows = torch.arange(part.start, part.stop, device=device)
            x0 = clean_table[rows, steps[part].to(device)]
            sigma, noise, cond = sigmas[part].to(device), seeded_noise(seeds[part], x0), self._round_cond(rows)
            if ac:  # the student's sample at the next level, σ_s, re-noised along (σ_s, σ_t]
                step = steps[part].to(device)
                state, level, sigma_s = (
                    rollout["visited"][rows, step],
                    self.process.sigma(step),
                    self.process.sigma(step + 1),
                )
                x_s = self._cps(
                    (state.float() - x0) / per_sample(level, x0), state, level, sigma_s, _noise(seeds[part], x0, 1)
                )
                sigma = self._above(sigma, sigma_s, fake=True)
                noisy, target, sigma_ts = renoise_interval(x_s, noise, sigma_s, sigma)
            else:
                noisy = self.process.add_noise(x0, noise, sigma)
            with self.fake_score.in_place() as model:
                with self.compute_loss_context_manager(), self._tapped(gan) as features:
                    velocity = self.policy.predict(model, noisy, cond, at=sigma)
                if ac:
                    loss = ambient_velocity_error(velocity, target, sigma_ts)
                    if args.consistency_weight > 0:
                        consistency = self._consistency(model, noisy, velocity, sigma, cond, seeds[part])
                        loss = loss + args.consistency_weight * consistency
                        self._record("dmd/consistency_loss", consistency.detach())
                else:
                    loss = flow_matching_error(velocity, noise, x0)
                if gan:
                    real = rollout["real"][rows]
                    real_sigma, real_noise = real_sigmas[part].to(device), seeded_noise(real_seeds[part], real)
                    with self.compute_loss_context_manager(), self.gan_tap.capture() as real_features:
                        self.policy.predict(
                            model, self.process.add_noise(real, real_noise, real_sigma), cond, at=real_sigma
                        )
                    real_logits, fake_logits = (
                        self._gan_logits(real_features, len(x0)),
                        self._gan_logits(features, len(x0)),
                    )
                    classifier = gan_discriminator_loss(real_logits, fake_logits)
                    loss = loss + args.gan_discriminator_weight * classifier
                    self._record("dmd/gan_discriminator_loss", classifier.detach())
                    self._record("dmd/gan_real_logit", real_logits.detach())
                    self._record("dmd/gan_fake_logit", fake_logits.detach())
                (loss.sum() / count).backward()
            losses.append(loss.detach())
        norm = self.fake_score.step(lambda t: self.accelerator.reduce(t, reduction="mean"))
        self._metrics["dmd/fake_score_loss"].append(torch.cat(losses).mean())
        self._metrics["dmd/fake_score_grad_norm"].append(norm.detach())

    def _consistency(
        self, model, noisy: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, cond, seeds: list[int]
    ) -> torch.Tensor:
        """RTDMD's consistency term (B,): the fake score's clean prediction h at x_t against h′ after each of two
        independent CPS moves of its own (detached) down to σ′ = σ_t − 0.2·u, u ~ U(0, 1) (RTDMD: up to 200 of 1,000
        timesteps)."""
        anchor = noisy - per_sample(sigma, velocity) * velocity.float()
        u = torch.special.ndtr(_noise(seeds, sigma[:, None], 2)[:, 0]).to(sigma)  # uniform: Φ of a standard normal
        lower = (sigma - 0.2 * u).clamp_min(0)
        after = []
        for stream in (3, 4):
            moved = self._cps(velocity.detach(), noisy, sigma, lower, _noise(seeds, noisy, stream))
            with torch.no_grad(), self.compute_loss_context_manager():
                v = self.policy.predict(model, moved, cond, at=lower)
            after.append(moved - per_sample(lower, v) * v.float())
        return consistency_loss(anchor, *after)

    def _tapped(self, on: bool):
        """The GAN tap's capture (a list of the forwards' features) when ``on``, else a list nothing fills."""
        return self.gan_tap.capture() if on else contextlib.nullcontext([])

    def _gan_logits(self, features: list[torch.Tensor], batch: int) -> torch.Tensor:
        """The GAN head's logits (``batch``,) of one fake-score forward's captured features (the conditional branch's,
        under CFG); the head's parameters join the fake score's optimizer when it is built."""
        if len(features) != 1:
            raise RuntimeError(
                f"the GAN head reads block {self.gan_tap.index} of the trained denoiser once per fake-score call; this "
                f"call ran it {len(features)} times (a frozen expert served it?)"
            )
        built = self.gan_head.layers is not None
        logits = self.gan_head(features[0][-batch:])
        if not built:
            self.fake_score.add_parameters(list(self.gan_head.parameters()))
        return logits

    def _generator_gan(
        self, noisy: torch.Tensor, cond: dict[str, torch.Tensor], sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fake score's prediction at x_σ (detached), DMD2's generator GAN loss (B,) and its gradient in x_σ. Both
        the fake score's forward and the backward to x_σ run here with its tensors in place (activation checkpointing
        recomputes in that backward); the student's loss reaches x_σ through a linear term in this gradient."""
        leaf = noisy.detach().requires_grad_(True)
        with self.fake_score.in_place() as model, self.gan_tap.capture() as features:
            fake = self.policy.predict(model, leaf, cond, at=sigma)
            loss = gan_generator_loss(self._gan_logits(features, len(leaf)))
            (gradient,) = torch.autograd.grad(loss.sum(), leaf)
        return fake.detach(), loss.detach(), gradient

    def _microbatch(self, item: tuple) -> dict[str, Any]:
        samples, steps, sigmas, seeds = item
        rollout, device = self._rollout, self.accelerator.device
        rows, steps = samples.to(device), steps.to(device)
        state = rollout["visited"][rows, steps]
        inputs = {"state": state, "step": steps, "cond": self._round_cond(rows)}
        if sigmas is None:  # RTDMD's PPO items: their transition, rollout log-prob and advantage
            return inputs | {
                "next_state": rollout["visited"][rows, steps + 1],
                "old_log_prob": rollout["log_probs"][rows, steps],
                "advantages": rollout["advantages"][rows],
            }
        return inputs | {
            "sigma": sigmas.to(device),
            "noise": seeded_noise(seeds, state),
            "seeds": seeds,
            "prompts": [rollout["prompts"][i] for i in samples.tolist()],
        }

    # ----------------------------------------------------------------------------------------------------------
    # Loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        velocity = self.policy.predict(model, inputs["state"], inputs["cond"], at=inputs["step"])
        if "advantages" in inputs:  # RTDMD's stage 2: a micro-batch of PPO items
            per_item = self._policy_gradient_loss(velocity, inputs)
        else:
            per_item = self._student_loss(model, velocity, inputs)
        loss = per_item.mean()
        return (loss, velocity) if return_outputs else loss

    def _policy_gradient_loss(self, velocity: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """RTDMD's PPO term (B,): the clipped surrogate of the CPS step's log-probability ratio to the rollout's, with
        the sample's group advantage; the log-probability is RTDMD's (and CPS's) pseudo one, −mean((x′ − μ)²)."""
        args = self.args
        step = self.policy.step(velocity, inputs["state"], inputs["step"], prev_sample=inputs["next_state"])
        log_ratio = step.log_prob - inputs["old_log_prob"]
        ratio, advantages = torch.exp(log_ratio), inputs["advantages"]
        per_item = clipped_surrogate(ratio, advantages, args.epsilon)
        with torch.no_grad():
            self._record("clip_ratio/region_mean", clipped_fraction(ratio, advantages, args.epsilon))
            self._record("ratio/mean", ratio)
            self._record("dmd/policy_gradient_loss", per_item)
        return per_item

    def _student_loss(self, model, velocity: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """DMD's student loss (B,) of the items whose prediction is ``velocity``: the generator loss (weighted), GAN
        and reward tilt where set."""
        policy, process = self.policy, self.process
        state, step, sigma, cond = inputs["state"], inputs["step"], inputs["sigma"], inputs["cond"]
        generated = process.predicted_clean(velocity, state, step)  # x̂0, with the student's gradient
        noise = inputs["noise"]
        if self.args.loss_type == "ac_dmd":  # judged at σ_s after its CPS transition; re-noised to σ_t ∈ (σ_s, σ_max]
            sigma_s, seeds = process.sigma(step + 1), inputs["seeds"]
            judged = self._cps(velocity, state, process.sigma(step), sigma_s, _noise(seeds, state, 1))
            sigma = self._above(sigma, sigma_s)
            judge_noise = _noise(seeds, state, 5)

            def renoise(x: torch.Tensor) -> torch.Tensor:
                return renoise_interval(x, noise, sigma_s, sigma)[0]

            def back(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # one CPS step to σ_s, noise shared
                return self._cps(v, x, sigma, sigma_s, judge_noise)
        else:  # DMD2: judged at its clean sample x_g, re-noised to σ
            judged = generated

            def renoise(x: torch.Tensor) -> torch.Tensor:
                return process.add_noise(x, noise, sigma)

            def back(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # the clean prediction
                return x.float() - per_sample(sigma, v.float()) * v.float()

        noisy = renoise(judged.detach())
        with torch.no_grad():
            real = self.reference_prediction(model, noisy, cond, sigma, self._teacher_policy)
        if self.gan_head is not None:
            fake, gan_loss, gan_gradient = self._generator_gan(noisy, cond, sigma)
        else:
            with torch.no_grad():
                fake = policy.predict(self.fake_score.model, noisy, cond, at=sigma)
        real_target, fake_target = back(real, noisy), back(fake, noisy)
        generator = dmd_loss(judged, real_target, fake_target)
        per_item = self.args.distribution_matching_weight * generator
        dims = tuple(range(1, noisy.ndim))
        self._record("dmd/generator_loss", generator)
        self._record("dmd/real_fake_distance", (fake_target - real_target).abs().mean(dim=dims))
        if self.gan_head is not None:
            # softplus(−D(x_σ)) in value; in gradient, its gradient in x_σ through x_σ's dependence on the judged sample.
            moved = renoise(judged)
            linear = ((moved - moved.detach()).float() * gan_gradient).flatten(1).sum(dim=1)
            self._record("dmd/gan_generator_loss", gan_loss)
            per_item = per_item + self.args.gan_generator_weight * (gan_loss + linear)
        if self.args.reward_tilt > 0:
            images = policy.decode(policy.final_latents(generated, cond))
            reward = sum(
                float(weight) * checked_score(func, inputs["prompts"], images)
                for func, weight in zip(self.reward_funcs, self.reward_weights)
            )
            self._record("dmd/tilt_reward", reward.detach())
            margin = self.args.reward_tilt_margin
            tilt = -reward if margin is None else torch.relu(margin - reward)  # RTDMD's hinge: none above the margin
            per_item = per_item + self.args.reward_tilt * tilt
        return per_item

    # ----------------------------------------------------------------------------------------------------------
    # Model card and checkpoints: the fake score and its optimizer travel with them

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        return super()._model_card_details() | {
            "sampling": f"{args.num_inference_steps} "
            + ("re-noised (DMD2's backward simulation)" if args.backward_simulation == "renoise" else "deterministic")
            + f" steps, guidance {args.guidance_scale}, "
            f"{self._sample_size()}",
            "DMD": (f"teacher {self._teacher_name()}, " if self._teacher_source is not None else "")
            + f"teacher guidance {args.teacher_guidance_scale}, {args.fake_score_updates} fake-score updates per "
            f"student update (lr {args.fake_score_learning_rate}), σ ~ U[{args.dmd_sigma_min}, {args.dmd_sigma_max}]"
            + (
                f" (fake score U[{args.fake_score_sigma_min}, {args.fake_score_sigma_max}])"
                if (args.fake_score_sigma_min, args.fake_score_sigma_max) != (args.dmd_sigma_min, args.dmd_sigma_max)
                else ""
            )
            + (f", reward tilt {args.reward_tilt}" if args.reward_tilt else "")
            + (
                f" (hinge at {args.reward_tilt_margin})"
                if args.reward_tilt and args.reward_tilt_margin is not None
                else ""
            )
            + (
                f", AC-DMD (CPS η {args.cps_eta}, consistency {args.consistency_weight})"
                if args.loss_type == "ac_dmd"
                else ""
            )
            + (
                f", RTDMD's stage 2 (PPO on {args.policy_gradient_steps} of the CPS steps at η {args.cps_eta}, clip "
                f"{args.epsilon}; DMD weight {args.distribution_matching_weight} at the last step)"
                if args.loss_type == "rtdmd"
                else ""
            )
            + (
                f", GAN (generator {args.gan_generator_weight}, classifier {args.gan_discriminator_weight}, block "
                f"{self.gan_tap.index})"
                if self.gan_head is not None
                else ""
            ),
        }

    def _teacher_name(self) -> str:
        source = self._teacher_source
        return source if isinstance(source, str) else type(source).__name__

    def _resume_state(self) -> dict[str, Any]:
        state = super()._resume_state() | {"fake_score": self.fake_score.state_dict()}
        if self.gan_head is not None and self.gan_head.layers is not None:
            state["gan_head"] = {name: value.cpu() for name, value in self.gan_head.state_dict().items()}
        return state

    def _restore_resume_state(self, state: dict[str, Any]) -> None:
        super()._restore_resume_state(state)
        if "gan_head" in state and self.gan_head is not None:  # built first: its tensors are in the saved optimizer
            self.gan_head.build(state["gan_head"]["layers.1.weight"].shape[1], self.accelerator.device)
            self.gan_head.load_state_dict(state["gan_head"])
            self.fake_score.add_parameters(list(self.gan_head.parameters()))
        self.fake_score.load_state_dict(state["fake_score"])


def _noise(seeds: list[int], like: torch.Tensor, stream: int) -> torch.Tensor:
    """Standard normal noise shaped as ``like``, row i from stream ``stream`` of item seed ``seeds[i]`` (AC-DMD's
    other draws: the student's transition 1, the consistency moves' levels 2 and noises 3, 4, the judges' step 5)."""
    return seeded_noise([mix_seed(seed, stream) for seed in seeds], like)


__all__ = ["DMDTrainer"]
