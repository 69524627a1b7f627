"""DiffusionOPD: several task teachers (LoRA adapters) distilled into one student along the student's own rollouts."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from datasets import IterableDataset

from ..lora import LORA_WEIGHTS_NAME
from ..losses import gaussian_step_kl
from .dance_grpo_trainer import DanceGRPOTrainer
from .diffusion_opd_config import DiffusionOPDConfig


class DiffusionOPDTrainer(DanceGRPOTrainer):
    """Multi-teacher on-policy distillation (DiffusionOPD, arXiv:2605.15055), with TRL's Trainer machinery.

    Each round the student (the trained LoRA) samples the round's prompts with :class:`DanceGRPOTrainer`'s sampler
    (SDE steps, windows, iso-temporal placement alike) and stores the transitions; each ``training_step`` recomputes a
    micro-batch of them with the student and, without gradients, with the teacher of each prompt's task (its LoRA
    adapter switched on in place of the student's), and minimises the closed-form KL between the two step Gaussians
    (:class:`DiffusionOPDConfig`). The rewards only monitor. The teachers are loaded once, as peft adapters beside the
    student's on the same denoiser: one copy of the base weights for all of them.

    The arguments are :class:`DanceGRPOTrainer`'s; ``peft_config`` (the student's LoRA) is required.
    """

    uses_likelihood_ratio = False

    _tag_names = ["trl", "trl-dance", "diffusion-opd", "diffusers"]
    _name = "DiffusionOPD"
    _paper = {
        "title": "DiffusionOPD: A Unified Perspective of On-Policy Distillation in Diffusion Models",
        "id": "2605.15055",
        "citation": "@article{li2026diffusionopd,\n  title={DiffusionOPD: A Unified Perspective of On-Policy Distillation in "
        "Diffusion Models},\n  author={Li, Quanhao and Yu, Junqiu and others},\n  journal={arXiv preprint "
        "arXiv:2605.15055},\n  year={2026}\n}",
    }

    config_class = DiffusionOPDConfig
    supports_async_rounds = False
    _synchronous_reason = "DiffusionOPD runs synchronous rounds only (its teachers' targets are taken per round)"

    def __init__(self, *args, peft_config=None, **kwargs):
        if peft_config is None:
            raise ValueError(
                "DiffusionOPDTrainer trains a student LoRA beside its teachers' (peft_config); full fine-tuning of the "
                "student is not supported"
            )
        super().__init__(*args, peft_config=peft_config, **kwargs)
        self._teacher_names = list(self.args.teachers)
        denoiser = self.policy.denoiser
        for index, (task, folder) in enumerate(self.args.teachers.items()):
            if not os.path.isfile(os.path.join(folder, LORA_WEIGHTS_NAME)):
                raise FileNotFoundError(f"teacher {task!r}: no {LORA_WEIGHTS_NAME} in {folder!r}")
            with warnings.catch_warnings():  # peft warns that the model already has an adapter: the student's
                warnings.simplefilter("ignore")
                denoiser.load_lora_adapter(
                    folder,
                    prefix=self.policy.denoiser_name,
                    adapter_name=f"teacher_{index}",
                    weight_name=LORA_WEIGHTS_NAME,
                )
        self._use_adapter(denoiser, "default")  # the student's active and trainable, the teachers' frozen
        self._round_tasks: torch.Tensor | None = None

    @classmethod
    def _check_dataset(cls, dataset, args: DiffusionOPDConfig) -> None:
        super()._check_dataset(dataset, args)
        if args.task_column not in (dataset.column_names or []):
            raise ValueError(f"train_dataset needs a {args.task_column!r} column naming each prompt's task")
        if not isinstance(dataset, IterableDataset):  # a stream is checked as it streams
            unknown = sorted(set(dataset[args.task_column]) - set(args.teachers))
            if unknown:
                raise ValueError(f"tasks {unknown} have no teacher; teacher_adapters has {list(args.teachers)}")

    def _use_adapter(self, model, name: str) -> None:
        """Switch every LoRA layer to adapter ``name`` (peft's ``set_adapter``: it also makes only that one
        trainable, so switching back to ``"default"`` restores the student's training state)."""
        for layer in self._reference_toggle(model)[1]:
            layer.set_adapter(name)

    def _generate_and_score_round(self, rows: list[dict[str, Any]]) -> None:
        column = self.args.task_column
        unknown = sorted({row[column] for row in rows} - set(self._teacher_names))
        if unknown:
            raise ValueError(f"tasks {unknown} have no teacher; teacher_adapters has {self._teacher_names}")
        self._round_tasks = torch.tensor([self._teacher_names.index(row[column]) for row in rows])
        super()._generate_and_score_round(rows)

    def _log_rollout_metrics(self, all_rewards, total, advantages, plan, calls_per_sample: float) -> None:
        super()._log_rollout_metrics(all_rewards, total, advantages, plan, calls_per_sample)
        tasks = self.data_parallel.gather(self._round_tasks.to(total.device))
        for index, task in enumerate(self._teacher_names):
            mine = tasks == index
            self._metrics[f"opd/{task}/reward"].append(total[mine].sum() / mine.sum().clamp_min(1))

    def _microbatch(self, indices: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = super()._microbatch(indices)
        inputs["teacher"] = self._round_tasks[indices[0]]  # host: which teacher forwards to run
        return inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        latents, step_index, cond = inputs["latents"], inputs["step_index"], inputs["cond"]
        output = self.policy.predict(model, latents, cond, at=step_index)
        teacher_output = torch.empty_like(output)
        with torch.no_grad():
            unwrapped = self._reference_toggle(model)[0]
            try:
                for index in inputs["teacher"].unique().tolist():
                    rows = (inputs["teacher"] == index).nonzero().flatten().to(latents.device)
                    self._use_adapter(model, f"teacher_{index}")
                    part = {key: value[rows] for key, value in cond.items()}
                    teacher_output[rows] = self.policy.predict(unwrapped, latents[rows], part, at=step_index[rows])
            finally:
                self._use_adapter(model, "default")
        if self.args.opd_target == "velocity":
            per_transition = ((output.float() - teacher_output.float()) ** 2).mean(dim=tuple(range(1, output.ndim)))
        else:
            next_latents = inputs["next_latents"]
            student = self.policy.step(output, latents, step_index, prev_sample=next_latents, compute_log_prob=False)
            teacher = self.policy.step(
                teacher_output, latents, step_index, prev_sample=next_latents, compute_log_prob=False
            )
            per_transition = gaussian_step_kl(student.mean, teacher.mean, student.std)
        self._record("opd/kl" if self.args.opd_target == "kl" else "opd/velocity_mse", per_transition)
        loss = per_transition.mean()
        return (loss, output) if return_outputs else loss

    def _model_card_details(self) -> dict[str, str]:
        details = super()._model_card_details()
        details.pop("GRPO", None)
        teachers = ", ".join(f"{task} ({folder})" for task, folder in self.args.teachers.items())
        return details | {"DiffusionOPD": f"teachers {teachers}; target {self.args.opd_target}"}


__all__ = ["DiffusionOPDTrainer"]
