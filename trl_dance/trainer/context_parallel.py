"""Context parallelism: one sample's token sequence split across the processes of a group, through diffusers'
``ContextParallelConfig`` and ``enable_parallelism`` (each transformer's ``_cp_plan``).

The processes form a (data parallel × context parallel) grid, rank = dp_rank · C + cp_rank. A context-parallel group
is one *virtual process*: its C ranks read the same prompts, draw the same noise (seeded by the data-parallel rank, so
results do not depend on C) and hold bit-identical latents, log-probabilities and losses; only the denoiser's attention
splits the sequence. Rewards are computed once per group (its first rank) and every statistic is gathered over data
parallel only (:class:`DataParallel`). Each rank's backward yields the gradient of its own slice of the sequence
(diffusers' all-gather hands each rank its slice of the output gradient), so the group's *sum* is the full gradient;
DDP, FSDP2 and DeepSpeed average over all ranks, so the denoiser's output gradient is scaled by C (the policy's
``runtime.gradient_scale``, shared by every copy of the policy).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import Sampler

CONTEXT_PARALLEL_TYPES = ("ulysses", "ring")
STREAMING_WITH_CONTEXT_PARALLEL = (
    "context_parallel_size > 1 needs a map-style train_dataset (a datasets.Dataset): the ranks of a group must read the "
    "same rows, which a stream sharded per process does not give; load it without streaming"
)


# Set by the `trl-dance` launcher while it validates a config for the processes it is about to start: their number, or
# "groups" (one context-parallel group: the world-size checks deferred until the launch options are known).
PLANNED_WORLD_SIZE = "TRL_DANCE_PLANNED_WORLD_SIZE"


@contextlib.contextmanager
def planned_world_size(value: int | str):
    """Validate configs inside for ``value`` processes (see :data:`PLANNED_WORLD_SIZE`), not this one process."""
    os.environ[PLANNED_WORLD_SIZE] = str(value)
    try:
        yield
    finally:
        os.environ.pop(PLANNED_WORLD_SIZE, None)


@dataclass
class ContextParallelArguments:
    r"""
    The context-parallel fields of every trainer's config.

    Parameters:
        context_parallel_size (`int`, defaults to `1`): C, the processes that split one sample's token sequence; the
            processes form (num_processes / C) data-parallel groups of C, each a *virtual process* (the batch sizes
            per process count per group). Needs a transformer with a context-parallel plan (Wan 2.1/2.2, FLUX.1,
            FLUX.1 Kontext, FLUX.2, Qwen-Image: diffusers'; HunyuanVideo: trl-dance's), a token count divisible by C
            (checked, naming sizes that would fit) and a map-style dataset; runs under DDP, FSDP2 and DeepSpeed ZeRO-2/3.
        context_parallel_type (`str`, defaults to `"ulysses"`): `"ulysses"`: an all-to-all over attention heads (the
            head count must divide by C; the `native` attention backend runs it on any device); `"ring"`: keys and
            values passed around the group (needs an attention backend returning the log-sum-exp, e.g. flash
            attention on GPUs; not with activation checkpointing).
    """

    context_parallel_size: int = field(
        default=1, metadata={"help": "Processes that split one sample's sequence (1: none)."}
    )
    context_parallel_type: str = field(
        default="ulysses",
        metadata={
            "help": "ulysses (all-to-all over heads) | ring (K/V passed around).",
            "choices": ["ulysses", "ring"],
        },
    )

    @property
    def planned_world_size(self) -> int:
        """The processes this config runs on: this run's, or the ones a launcher is about to start."""
        planned = os.environ.get(PLANNED_WORLD_SIZE)
        if planned == "groups":
            return self.context_parallel_size
        return int(planned) if planned else self.world_size

    def _check_context_parallel(self) -> None:
        size, world = self.context_parallel_size, self.planned_world_size
        if self.context_parallel_type in ("ulysses_anything", "ring_anything"):
            raise ValueError(
                f"context_parallel_type {self.context_parallel_type!r}: diffusers' *_anything modes (any sequence length "
                "or head count) run forward only, with no backward to train through: use 'ulysses' or 'ring' with a "
                "token count and head count the group size divides"
            )
        if self.context_parallel_type not in CONTEXT_PARALLEL_TYPES:
            raise ValueError(
                f"context_parallel_type must be one of {list(CONTEXT_PARALLEL_TYPES)}, got {self.context_parallel_type!r}"
            )
        if size < 1:
            raise ValueError(f"context_parallel_size must be >= 1, got {size}")
        if size == 1:
            return
        if self.context_parallel_type == "ring" and self.activation_checkpointing:
            raise ValueError(
                "context_parallel_type='ring' with activation_checkpointing: diffusers' ring attention unpacks its "
                "saved tensors twice under recomputation (CheckpointError); use 'ulysses' or turn checkpointing off"
            )
        if world % size:
            raise ValueError(
                f"context_parallel_size ({size}) must divide the number of processes ({world}): the processes form "
                "groups of context_parallel_size"
            )

    @property
    def data_parallel_size(self) -> int:
        """Virtual processes: ``num_processes / context_parallel_size``."""
        return self.planned_world_size // self.context_parallel_size


class DataParallel:
    """The trainer's view of its virtual processes: rank and size over data parallel, and gathers over them (each
    context-parallel group contributes its first rank's values). With ``context_parallel_size`` 1 it is accelerate's."""

    def __init__(self, accelerator: Accelerator, context_parallel_size: int = 1):
        self.accelerator = accelerator
        self.group = context_parallel_size
        self.size = accelerator.num_processes // context_parallel_size
        self.rank = accelerator.process_index // context_parallel_size
        self.group_rank = accelerator.process_index % context_parallel_size

    @property
    def is_group_leader(self) -> bool:
        """The group's first rank (it scores rewards for the group)."""
        return self.group_rank == 0

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """(size · B, ...) the B rows of every virtual process, in data-parallel rank order."""
        gathered = self.accelerator.gather(tensor)
        if self.group == 1:
            return gathered
        return gathered.unflatten(0, (self.accelerator.num_processes, -1))[:: self.group].flatten(0, 1)

    def gather_object(self, items: list) -> list:
        """Every virtual process's ``items`` (the same length on every process), concatenated in rank order."""
        gathered = gather_object(items)
        if self.group == 1:
            return gathered
        count = len(items)
        return [
            item
            for rank in range(0, self.accelerator.num_processes, self.group)
            for item in gathered[rank * count : (rank + 1) * count]
        ]

    @contextlib.contextmanager
    def split(self, items: list) -> Iterator[list]:
        """This virtual process's contiguous share of ``items``, padded with the last item to equal shares (as
        ``Accelerator.split_between_processes(apply_padding=True)``)."""
        if self.group == 1:
            with self.accelerator.split_between_processes(items, apply_padding=True) as mine:
                yield mine
            return
        share = math.ceil(len(items) / self.size)
        mine = items[self.rank * share : (self.rank + 1) * share]
        yield mine + [items[-1]] * (share - len(mine))


class GroupReplicatedSampler(Sampler):
    """A sampler whose global batches of ``size · block`` indices are handed to the ranks of each context-parallel
    group alike: each block of ``block`` indices is yielded ``group`` times in a row, so accelerate's per-process split
    (process p takes the p-th block of each global batch) gives rank dp·C + c the block dp."""

    def __init__(self, sampler: Sampler, block: int, size: int, group: int):
        self.sampler, self.block, self.size, self.group = sampler, block, size, group

    def __len__(self) -> int:
        return len(self.sampler) * self.group

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.block * self.size:
                for start in range(0, len(batch), self.block):
                    for _ in range(self.group):
                        yield from batch[start : start + self.block]
                batch = []


def check_context_parallel(policy, size: int, kind: str) -> None:
    """Raise ``ValueError``, before any model work, if ``policy``'s denoiser cannot split its sequence over ``size``
    ranks: no diffusers plan for the family, heads (Ulysses) or split token counts not divisible by ``size``."""
    denoiser, name = policy.denoiser, type(policy.denoiser).__name__
    if policy.context_parallel_plan() is None and getattr(type(denoiser), "_cp_plan", None) is None:
        raise ValueError(
            f"{name} ({type(policy.pipeline).__name__}) has no context-parallel plan in diffusers; context parallelism "
            "runs on Wan 2.1/2.2, HunyuanVideo, FLUX.1/Kontext, FLUX.2 and Qwen-Image transformers: set "
            "context_parallel_size 1"
        )
    if kind == "ring" and policy.masks_text:
        raise ValueError(
            f"context_parallel_type='ring' with {name}: its attention masks the padded prompt tokens, and diffusers' "
            "ring attention applies each rank's key mask to the other ranks' keys (silently wrong): use 'ulysses'"
        )
    heads = denoiser.config.get("num_attention_heads")
    if kind == "ulysses" and heads is not None and heads % size:
        raise ValueError(
            f"Ulysses attention splits the {heads} attention heads of {name} over context_parallel_size ({size}) "
            "ranks: use a size dividing the heads, or context_parallel_type='ring'"
        )
    try:
        lengths = policy.context_parallel_lengths()
    except NotImplementedError as error:
        raise ValueError(f"{error}: set context_parallel_size 1") from None
    for what, count in lengths.items():
        if count % size:
            divisors = [d for d in range(2, count + 1) if count % d == 0][:6]
            raise ValueError(
                f"{what}: {count} tokens per sample do not split over context_parallel_size ({size}) ranks; change "
                f"{policy.context_parallel_hint()} or use a context_parallel_size dividing {count} (e.g. {divisors})"
            )


def enable_context_parallel(policy, models: list[torch.nn.Module], size: int, kind: str, device: torch.device) -> None:
    """Split the sequence of every model in ``models`` (the trained denoiser, a frozen expert, a reference copy) over
    context-parallel groups of ``size`` ranks with the policy's plan (default diffusers'), on a ("dp", "ring",
    "ulysses") mesh."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    shape = (world // size, size, 1) if kind == "ring" else (world // size, 1, size)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "ring", "ulysses"))
    degrees = {"ring_degree": size} if kind == "ring" else {"ulysses_degree": size}
    # diffusers places each rank on `rank % torch.accelerator.device_count()`, which CPU-only torch counts 0.
    count = torch.accelerator.device_count() if device.type != "cpu" else 1
    with mock.patch.object(torch.accelerator, "device_count", lambda: count):
        for model in models:
            model.enable_parallelism(
                config=ContextParallelConfig(mesh=mesh, **degrees), cp_plan=policy.context_parallel_plan()
            )
            policy.prepare_context_parallel(model, size)
