"""Configuration of :class:`~trl_dance.DiffusionOPDTrainer`."""

from dataclasses import dataclass, field

from .dance_grpo_config import TransitionSamplingArguments
from .rollout_config import RolloutConfig, SDEArguments, _choice

OPD_TARGETS = ("kl", "velocity")


@dataclass
class DiffusionOPDConfig(TransitionSamplingArguments, SDEArguments, RolloutConfig):
    r"""
    Configuration for [`DiffusionOPDTrainer`]: multi-teacher on-policy distillation (DiffusionOPD, arXiv 2605.15055).

    One teacher per task (a LoRA of the same base model, trained by any trainer here, e.g. GRPO on one reward and
    DiffusionNFT on another) is distilled into one student LoRA along the student's own rollouts: each prompt names its
    task in `task_column`, and each of its sampled transitions x_t → x_{t+1} is trained toward that task's teacher by
    the closed-form KL of the two step Gaussians (the same state, the same std: mean matching). Rollouts, SDE windows,
    `timestep_fraction` / `timestep_selection` and the micro-batch units are [`DanceGRPOConfig`]'s
    ([`~trl_dance.trainer.dance_grpo_config.TransitionSamplingArguments`]); the reward functions only monitor
    (`reward`, `rewards/*` and `opd/<task>/reward` are logged; no advantage enters the loss), so GRPO's
    policy-gradient fields are not this config's (`beta`, the reference KL, is refused).

    Parameters:
        teacher_adapters (`list[str]`): `"task=path"` per task: a folder holding `pytorch_lora_weights.safetensors`
            in the diffusers format every trainer here saves (and `pipeline.load_lora_weights` reads), for the
            student's base model.
        task_column (`str`, defaults to `"task"`): The dataset column naming each prompt's task (one of
            `teacher_adapters`' names).
        opd_target (`str`, defaults to `"kl"`): `"kl"`, the exact per-step KL mean((μ_s − μ_T)²)/(2·std²) per latent
            element (the paper's mean matching in x_t space); `"velocity"`, mean((v_s − v_T)²) on the network outputs,
            which weighs every step alike (the KL is it times g_t²/2, g_t = |∂μ/∂output|/std, largest at low noise)
            and stays finite for deterministic rollouts.
    """

    updates_per_round = 3  # as DanceGRPO's (the same transition micro-batches)
    # GRPO's policy-gradient options, fixed off: the loss is the KL to each task's teacher (the trainer is GRPO's
    # engine with that loss).
    epsilon, epsilon_high, loss_type, trust_region, dppo_kl_threshold, dppo_kl_space = (
        1e-4,
        None,
        "dapo",
        "clip",
        0,
        "x",
    )
    ratio_normalization = step_reweighting = rollout_backprop = temporal_rectification = False
    kl_scaling, best_of_n_k = "gaussian", None

    teacher_adapters: list[str] = field(
        default_factory=list, metadata={"help": "task=path of each teacher's LoRA folder (diffusers format)."}
    )
    task_column: str = field(default="task", metadata={"help": "Dataset column naming each prompt's task."})
    opd_target: str = field(
        default="kl", metadata={"help": "kl (exact step KL) | velocity (output MSE).", "choices": list(OPD_TARGETS)}
    )

    def _check_method(self) -> None:
        self._check_sde("a deterministic step has no log-probability")
        self._check_transitions()
        _choice("opd_target", self.opd_target, OPD_TARGETS)
        if not self.teacher_adapters:
            raise ValueError("teacher_adapters must name at least one teacher as 'task=path'")
        names = [entry.split("=", 1)[0] for entry in self.teacher_adapters]
        if any(
            "=" not in entry or not entry.split("=", 1)[0] or not entry.split("=", 1)[1]
            for entry in self.teacher_adapters
        ):
            raise ValueError(f"teacher_adapters entries are 'task=path', got {self.teacher_adapters}")
        if len(set(names)) != len(names):
            raise ValueError(f"teacher_adapters names a task twice: {names}")
        if self.beta > 0:
            raise ValueError("DiffusionOPD's loss is the KL to each task's teacher: beta > 0 does not apply")

    @property
    def teachers(self) -> dict[str, str]:
        """Task name → LoRA folder, in the order given."""
        return dict(entry.split("=", 1) for entry in self.teacher_adapters)
