"""Configuration of :class:`~trl_dance.SPOTrainer`."""

from dataclasses import dataclass, field
from typing import Any

from .rollout_config import RolloutConfig, SDEArguments, _choice


@dataclass
class SPOConfig(SDEArguments, RolloutConfig):
    r"""
    Configuration for [`SPOTrainer`]: Step-aware Preference Optimization (Liang et al., arXiv:2406.04314).

    Defaults follow SPO's SD1.5 recipe (20 DDIM steps with η = 1 and CFG 5, pools of 4 candidates from step 4 on,
    pair threshold 0.3, β 10, ratio clip 0.1, LoRA lr 6e-5). Generation, reward and model fields:
    [`~trl_dance.trainer.rollout_config.RolloutConfig`] (`num_generations` is 1: SPO has no groups).

    Units. Each prompt of a round is one chain; each of its pool steps gives one candidate pair, so a process holds
    ``generation_batch_size / num_processes × pool steps`` pairs per round, ``per_device_train_batch_size`` of them per
    micro-batch. Pool steps are the steps from `pool_start_step` on, the last one included (its candidates are clean
    samples, judged at timestep 0, as SPO's). A pair below the threshold is dropped, not reweighted: each kept pair
    weighs 1/`per_device_train_batch_size` in its micro-batch, and kept pairs fill the round's first micro-batches.

    Parameters:
        > Rollouts

        pool_size (`int`, defaults to `4`): k, candidates x_{t−1} sampled from each shared x_t (SPO: 4 for SD1.5, 2 for
            SDXL). At least 2.
        pool_start_step (`int`, defaults to `4`): The first step with a pool (SPO's `divert_start_step`: the
            high-noise steps before it are plain stochastic steps).
        pair_threshold (`float`, defaults to `0.3`): A pool gives a pair only if the softmax of its best and worst
            scores (× `score_scale`) differ by more than this: tanh(score_scale · (s_best − s_worst) / 2) > threshold
            (SPO: 0.3 for SD1.5, 0.4 for SDXL, on its preference model's logits). Pairs below are masked and counted in
            `pairs/kept`.
        score_scale (`float` or `None`, defaults to `None`): Multiplies the scores before that softmax. `None`: 1 for
            SPO's step-aware preference model (the threshold is tuned on its logits), and for any other scorer
            1 / (the round's mean best-worst gap over all processes), so whatever the scorer's units a pool is kept
            when its gap exceeds 2·atanh(`pair_threshold`) ≈ 0.62 of the mean gap (at 0.3).
        pool_last_step (`bool`, defaults to `True`): Pool the last step too (SPO); a stochastic step without noise
            there (`sde_type="cps"` onto σ = 0) has no pairs: set False.
        step_aware_model (`str` or `None`, defaults to `None`): SPO's step-aware preference model as the step scorer
            (:class:`~trl_dance.rewards.step_aware.StepAwarePreferenceModel`): its `.bin` file, a folder holding it, or
            a Hub repo (`SPO-Diffusion-Models/Step-Aware_Preference_Models`). `None`: the weighted `reward_funcs` on
            each candidate's decoded x̂0. A `step_scorer` given to the trainer takes precedence.
        step_aware_model_kwargs (`dict` or `None`, defaults to `None`): Its other arguments: `filename`
            (`sd-v1-5_step-aware_preference_model.bin` or `sdxl_step-aware_preference_model.bin`), `model` (the
            PickScore `CLIPModel` whose config it follows), `tokenizer`, `dtype`, `batch_size`.
        sde_type (`str`, defaults to `"dance"`), eta (`float`, defaults to `1.0`), log_prob_reduction (`str`,
            defaults to `"mean"`): The stochastic step, as in [`DanceGRPOConfig`]: DDIM with η = `eta` for SD1.x/SDXL
            (SPO's η 1), the flow SDE or CPS for flow models (SPO's paper: a deterministic flow sampler has no pairs
            to compare). `"mean"` is SPO's (DDPO's) per-element mean log-density, which β 10 assumes.

        > Loss

        beta (`float`, defaults to `10.0`): SPO's β in −log σ(β·log ρ_w − β·log ρ_l) (not a KL coefficient).
        epsilon (`float`, defaults to `0.1`): The ratios ρ = π_θ/π_ref are clipped to [1 − ε, 1 + ε]. The reference is
            the LoRA-disabled base (a frozen copy for full fine-tuning).
    """

    _VALID_DICT_FIELDS = [*RolloutConfig._VALID_DICT_FIELDS, "step_aware_model_kwargs"]
    min_generations = 1  # a chain per prompt, no group statistics

    learning_rate: float = field(default=6e-5, metadata={"help": "AdamW learning rate (SPO SD1.5 LoRA: 6e-5)."})
    num_generations: int = field(default=1, metadata={"help": "Chains per prompt (SPO: 1)."})
    num_inference_steps: int = field(default=20, metadata={"help": "Denoising steps N."})
    guidance_scale: float = field(default=5.0, metadata={"help": "CFG scale in sampling and loss (SPO: 5)."})
    per_device_train_batch_size: int = field(default=1, metadata={"help": "Pairs per micro-batch per process."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer update."})
    eta: float = field(default=1.0, metadata={"help": "Noise level of the stochastic step (DDIM η; > 0)."})
    share_initial_noise: str = field(
        default="none", metadata={"help": "none: every chain its own initial noise.", "choices": ["none"]}
    )
    pool_size: int = field(default=4, metadata={"help": "Candidates per pool (k >= 2)."})
    pool_start_step: int = field(default=4, metadata={"help": "First step with a candidate pool."})
    pair_threshold: float = field(default=0.3, metadata={"help": "Softmax score gap a pair needs."})
    score_scale: float | None = field(
        default=None, metadata={"help": "Scale of the scores inside that softmax (None: 1 / the round's mean gap)."}
    )
    pool_last_step: bool = field(default=True, metadata={"help": "Pool the last step too (SPO)."})
    step_aware_model: str | None = field(
        default=None, metadata={"help": "SPO's step-aware preference model (.bin, folder or Hub repo) as the scorer."}
    )
    step_aware_model_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Its filename, model, tokenizer, dtype, batch_size (JSON)."}
    )
    beta: float = field(default=10.0, metadata={"help": "SPO's β."})
    epsilon: float = field(default=0.1, metadata={"help": "Clip range of the per-step ratios."})

    def _check_method(self) -> None:
        self._check_sde("candidates of a deterministic step are identical")
        _choice("share_initial_noise", self.share_initial_noise, ("none",))
        if self.pool_size < 2:
            raise ValueError(f"pool_size must be >= 2: a pool of {self.pool_size} candidate(s) forms no pair")
        if not 0 <= self.pool_start_step < self.num_inference_steps - 1:
            raise ValueError(
                f"pool_start_step must be in [0, {self.num_inference_steps - 1}) (pools are on the first N − 1 steps), "
                f"got {self.pool_start_step}"
            )
        if not 0 <= self.pair_threshold < 1:
            raise ValueError(f"pair_threshold is a softmax gap in [0, 1), got {self.pair_threshold}")
        if (self.score_scale is not None and self.score_scale <= 0) or self.beta <= 0 or not 0 < self.epsilon < 1:
            raise ValueError(
                f"score_scale and beta must be > 0 and epsilon in (0, 1), got {self.score_scale}, {self.beta}, "
                f"{self.epsilon}"
            )

    @property
    def num_pool_steps(self) -> int:
        """Pool steps per chain."""
        return self.num_inference_steps - self.pool_start_step - (0 if self.pool_last_step else 1)

    def _round_items(self) -> tuple[int, str]:
        chains = self.per_device_generation_batch_size
        return chains * self.num_pool_steps, f"{chains} chains × {self.num_pool_steps} pool steps (pairs)"
