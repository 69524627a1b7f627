"""Configuration of :class:`~trl_dance.DiffusionDPOTrainer`."""

from dataclasses import dataclass, field

from .dataset_config import DatasetTrainingConfig
from .pair_denoising import DPOLossArguments


@dataclass
class DiffusionDPOConfig(DPOLossArguments, DatasetTrainingConfig):
    r"""
    Configuration for [`DiffusionDPOTrainer`]: Diffusion-DPO (Wallace et al., 2023) on image preference pairs.

    Per pair, one timestep and one noise are shared by the chosen (w) and rejected (l) image. With per-sample
    denoising errors ``e = mean((pred − target)²)`` (float32, over C, H, W) of the policy and the reference, the
    implicit rewards are ``β·r_w = −β/2·(e_θ^w − e_ref^w)`` and ``β·r_l`` likewise, ``z = β(r_w − r_l)``, and the loss
    is TRL's for each `loss_type` in them: ``−log σ(z)`` (sigmoid), ``relu(1 − z)`` (hinge), ``(r_w − r_l −
    1/(2β))²`` (ipo), ... Targets: ε (or v) for SD1.x/SDXL, the velocity ``ε − x0`` for rectified flow (SD3, FLUX).

    Parameters:
        beta (`float`, defaults to `5000.0`): β in the units above: 2000–5000 for SD1.5/SDXL; flow-matching ports use
            much smaller values (e.g. 100).
        loss_type (`list[str]`, defaults to `["sigmoid"]`): TRL's DPO loss types, summed with `loss_weights`:
            `"sigmoid"`, `"hinge"`, `"ipo"`, `"robust"`, `"exo_pair"`, `"bco_pair"`, `"apo_zero"`, `"apo_down"` and
            `"sft"` (the denoising loss on the chosen image; alone, it trains without a reference), e.g.
            `["sigmoid", "sft"]`.
        loss_weights (`list[float]` or `None`, defaults to `None`): One weight per loss type (`None`: 1 each).
        label_smoothing (`float`, defaults to `0.0`): The probability that a label is flipped, as in TRL: `robust`
            needs it in [0, 0.5), `exo_pair` in (0, 1).
        weighting_scheme (`str`, defaults to `"none"`): Flow models, as diffusers' training scripts
            (`compute_density_for_timestep_sampling`): u ~ U(0, 1) (`"none"`), sigmoid(N(logit_mean, logit_std))
            (`"logit_normal"`) or the SD3 paper's `"mode"` density; then σ = the scheduler's own training grid at
            ⌊u · T_train⌋, so the pipeline's shift applies (SD3: 3; FLUX's dynamic shift: none). ε models always draw
            t uniformly in [0, T_train).
        logit_mean (`float`, defaults to `0.0`), logit_std (`float`, defaults to `1.0`), mode_scale (`float`,
            defaults to `1.29`): parameters of those densities.
        resolution (`int`, defaults to `512`): Training images are resized (shorter side) and cropped to this.
        num_frames (`int` or `None`, defaults to `None`): Video models (Wan): each video of a pair is cut to its first
            `num_frames` frames (1 + a multiple of the VAE's temporal factor, 4 for Wan; `None`: the family's default,
            81 for Wan); every frame of both videos gets the same resize, crop and flip. Image models: must be `None`.
        random_crop (`bool`, defaults to `False`): Random instead of centre crop (the same box for both images).
        random_flip (`bool`, defaults to `True`): Flip a pair horizontally with probability ½ (both images).
        proportion_empty_prompts (`float`, defaults to `0.0`): Caption dropout (the paper's recipe: 0.2).
        max_missing_images (`int` or `None`, defaults to `100`): Pairs with a missing image (no file, no bytes) are
            skipped, counted in `data/missing_images` and warned about once; training stops when a process has skipped
            more than this many. `None`: never stop.
        ties (`str`, defaults to `"drop"`): Pick-a-Pic ties (`label_0 = 0.5`): `"drop"` them (counted in the log), or
            `"keep"` them with the loss averaged over both orders (they count ½ in `implicit_acc`).
        guidance_scale (`float`, defaults to `3.5`): FLUX's guidance-embedding value during training; unused by
            families with CFG.
        max_sequence_length (`int`, defaults to `512`): T5 tokens (SD3, FLUX).
        merge_lora (`list[str]` or `None`, defaults to `None`): LoRA folders in the diffusers format (what every
            trainer here saves) fused into the base weights, in order, before training: training starts from the
            merged model, which is also the reference (LoRA disabled). RL on a student distilled here (RTDMD's
            `merge_before_training`), or on any fine-tune.
        model_init_kwargs (`dict` or `None`, defaults to `None`): Keyword arguments of
            `DiffusionPipeline.from_pretrained` when `model` is a string.
        frozen_dtype, offload_text_encoders: memory settings of the VAE and text encoders, see
            [`~trl_dance.trainer.frozen_components.FrozenComponentsArguments`].
        use_ema, ema_decay: an EMA of the trained parameters, see [`~trl_dance.trainer.ema.EMAArguments`].
        context_parallel_size, context_parallel_type: split each sample's token sequence over groups of processes
            (videos at full size), see [`~trl_dance.trainer.context_parallel.ContextParallelArguments`].

        > Evaluation (`eval_dataset`, `eval_strategy`, `eval_steps`, `per_device_eval_batch_size` as in TRL)

        eval_prompts (`list[str]` or `None`, defaults to `None`): Prompts sampled at every evaluation (deterministic
            sampler, fixed noise, the EMA with `use_ema`), sent to the trackers and written to
            `eval_samples_step<N>.png`.
        eval_seed, eval_num_inference_steps, eval_guidance_scale, eval_negative_prompt: the noise seed (of the
            images and of the eval loss's timesteps and noise) and the sampler settings (default: the pipeline's
            own), see [`~trl_dance.trainer.evaluation.EvaluationArguments`].
    """

    ties: str = field(default="drop", metadata={"help": "drop | keep Pick-a-Pic ties.", "choices": ["drop", "keep"]})

    def __post_init__(self):
        super().__post_init__()
        self._check_dpo_loss()
        if self.ties not in ("drop", "keep"):
            raise ValueError(f"ties must be 'drop' or 'keep', got {self.ties!r}")
