"""Rollouts on other processes: the protocol of ``trl-dance serve-rollouts`` and the worker's state.

A worker holds the base pipeline and, after a handshake with the trainer (the sampler settings, the LoRA's shape, the
autocast dtype, a fingerprint of the frozen denoiser and the software versions, each compared), versions of the
rollout weights the trainer publishes. A request is one rollout chunk of the trainer's: its conditioning, initial
noise and the state of each sample's noise generator after it, the round's noise plan, its groups; the worker runs the
sampler the trainer would run (:func:`trl_dance.sampling.generate`) with that version's tensors copied into its LoRA,
and answers with the rollout and the SHA-256 of the tensors it sampled with, read back from its live parameters. So a
chunk equals the in-process chunk bit for bit on the same device type and software, and a worker that did not bind
the version it claims cannot answer with its hash.

Bodies are safetensors (tensors, and a JSON string under the metadata key ``"json"``): no pickle, no base64.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .lora import add_lora
from .policies import SamplerSettings, make_policy
from .rewards.remote import RefusedInput
from .sampling import RolloutPlan, generate

LORA_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora")
ROLLOUT_TOKEN_ENV = "TRL_DANCE_ROLLOUT_TOKEN"


def pack(tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> bytes:
    """A safetensors body of ``tensors`` (moved to the CPU) with ``info`` as JSON metadata. Each tensor is stored in
    its memory order and :func:`unpack` restores its strides: a reduction over a channels-last image sums in another
    order than over the same values laid out contiguously (a reward's mean then differs in its last bits)."""
    orders = {key: list(value.dim_order()) for key, value in tensors.items()}
    owned = {key: value.detach().to("cpu").permute(orders[key]).contiguous() for key, value in tensors.items()}
    return save_tensors(owned, metadata={"json": json.dumps(info), "dim_order": json.dumps(orders)})


def unpack(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the JSON metadata of a :func:`pack` body (safetensors: an 8-byte little-endian header length,
    then the JSON header, whose ``__metadata__`` holds ours)."""
    try:
        size = int.from_bytes(body[:8], "little")
        metadata = json.loads(body[8 : 8 + size]).get("__metadata__") or {}
        orders = json.loads(metadata.get("dim_order", "{}"))
        tensors = {}
        for key, value in load_tensors(body).items():
            order = orders.get(key, list(range(value.ndim)))
            # Its own allocation (set_state of a generator ignores a view's offset), then its sender's strides.
            tensors[key] = value.clone().permute([order.index(d) for d in range(value.ndim)])
        return tensors, json.loads(metadata["json"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"not a trl-dance rollout message (safetensors with a 'json' metadata entry): {err}"
        ) from None


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors in a canonical form: sorted names, each with its dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def trainable_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's trainable parameters by name (a LoRA's, on a frozen base)."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


@torch.no_grad()
def base_fingerprint(module: torch.nn.Module) -> str:
    """A digest of the frozen weights (name, shape, dtype, float64 sum and sum of squares per tensor): two processes
    that loaded different checkpoints, dtypes or revisions disagree."""
    digest = hashlib.sha256()
    for name, value in module.named_parameters():
        if not value.requires_grad:
            wide = value.detach().double()
            digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|{wide.sum().item()!r}|".encode())
            digest.update(repr((wide * wide).sum().item()).encode())
    return digest.hexdigest()


def lora_description(config: LoraConfig) -> dict[str, Any]:
    """The fields of a LoRA that decide its parameters' names, shapes and forward (JSON)."""
    values = {name: getattr(config, name) for name in LORA_FIELDS}
    target = values["target_modules"]
    values["target_modules"] = sorted(target) if isinstance(target, (set, list, tuple)) else target
    return values


def software() -> dict[str, str]:
    import diffusers

    from .version import __version__

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "trl_dance": __version__}


def sampling_identity(policy) -> dict[str, Any]:
    """What trainer and worker must share to sample alike, beyond the settings they exchange: the policy class, the
    frozen denoiser's fingerprint, the software versions and the LoRA parameters' names and shapes (compared at the
    handshake)."""
    frozen = [p for p in policy.denoiser.parameters() if not p.requires_grad]
    return {
        "policy": type(policy).__name__,
        "denoiser": type(policy.denoiser).__name__,
        "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in frozen}),  # named before the digest says why
        "software": software(),
        "parameters": {name: list(p.shape) for name, p in trainable_tensors(policy.denoiser).items()},
        "fingerprint": base_fingerprint(policy.denoiser),
    }


def identity_differences(worker: dict[str, Any], trainer: dict[str, Any]) -> list[str]:
    """Each difference of two :func:`sampling_identity` values, named: ``"dtypes: worker ['bfloat16'], trainer
    ['float32']"``, a mapping's differing entries one by one (``software.torch``, a LoRA parameter), digests cut."""

    def show(value: Any) -> str:
        return repr(value[:12] + "…") if isinstance(value, str) and len(value) > 40 else repr(value)

    differences = []
    for key in worker:
        mine, theirs = worker[key], trainer.get(key)
        if mine == theirs:
            continue
        if isinstance(mine, dict) and isinstance(theirs, dict):
            names = sorted(name for name in mine.keys() | theirs.keys() if mine.get(name) != theirs.get(name))
            differences += [f"{key}.{n}: worker {show(mine.get(n))}, trainer {show(theirs.get(n))}" for n in names[:5]]
            differences += [f"{key}: {len(names) - 5} more"] if len(names) > 5 else []
        else:
            differences.append(f"{key}: worker {show(mine)}, trainer {show(theirs)}")
    return differences


class RolloutWorker:
    """The state of one ``serve-rollouts`` process: its pipeline, the policy and LoRA of the trainer it serves, and
    the versions of the rollout weights it holds (at most ``max_versions``, the oldest evicted first).

    Args:
        pipeline: the base pipeline, on ``device``.
        device: where the denoiser runs.
        max_versions: versions kept (the trainer's ``max_staleness`` + 2 suffices).
    """

    def __init__(self, pipeline, device: str | torch.device, max_versions: int = 4):
        self.pipeline, self.device, self.max_versions = pipeline, torch.device(device), max_versions
        self.loading: str | None = None  # the model being loaded (the worker answers /health meanwhile)
        self.failed: str | None = None  # why it could not be loaded
        self.policy = None
        self._lora: dict[str, Any] | None = None
        self.mixed_precision = "no"
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.served = 0
        self._lock = threading.Lock()  # one chunk (or weight copy) at a time: the LoRA parameters are shared

    def load(self, load_pipeline: Callable[[], Any], model: str) -> None:
        """Set ``self.pipeline = load_pipeline()`` (on a thread, while the server answers ``/health`` with
        ``loading``); a failure is kept and reported by ``/health``."""
        self.loading = model
        try:
            self.pipeline = load_pipeline()
        except Exception as error:  # reported to the trainer, which stops naming it
            self.failed = f"{type(error).__name__}: {error}"
            raise
        finally:
            self.loading = None

    def health(self) -> dict[str, Any]:
        if self.failed or self.pipeline is None:
            status = {"status": "failed", "error": self.failed} if self.failed else {"status": "loading"}
            return status | {"model": self.loading}
        return {
            "status": "ready" if self.policy is not None else "waiting for a handshake",
            "pipeline": type(self.pipeline).__name__,
            "versions": sorted(self.versions),
            "served": self.served,
        }

    def handshake(self, info: dict[str, Any]) -> dict[str, Any]:
        """Build the trainer's policy and LoRA from ``info`` and compare what must match; 409 naming every
        difference."""
        if self.pipeline is None:
            raise RefusedInput(503, f"the worker is not ready: {self.health()}")
        with self._lock:
            policy = make_policy(self.pipeline, SamplerSettings(**info["settings"]))
            policy.use_condition_columns(info.get("condition_columns", []))  # (the trainer's optional columns)
            if self._lora is None:
                add_lora(policy.denoiser, LoraConfig(**info["lora"]))
                # float32 as the trainer keeps it (DiffusionTrainer): on a bf16 base peft makes the LoRA bf16, and the
                # published float32 versions would be refused.
                cast_training_params(policy.denoiser, torch.float32)
                self._lora = info["lora"]
            elif self._lora != info["lora"]:
                raise RefusedInput(
                    409, f"the worker holds the LoRA {self._lora} of an earlier trainer; restart it for {info['lora']}"
                )
            mine = sampling_identity(policy)
            differences = identity_differences(mine, info)
            if differences:
                raise RefusedInput(409, "the worker cannot sample as the trainer does: " + "; ".join(differences))
            self.policy, self.mixed_precision, self.versions = policy, info.get("mixed_precision", "no"), {}
            return {"fingerprint": mine["fingerprint"]}

    def load_version(self, version: int, tensors: dict[str, torch.Tensor]) -> str:
        """Keep ``tensors`` as version ``version`` after a strict check against the LoRA's parameters (names, shapes,
        dtypes: a loader that skips unknown names would bind nothing), copy them in, and return the SHA-256 of the
        live parameters read back."""
        with self._lock:
            live = self._live()
            if set(tensors) != set(live):
                missing, unknown = sorted(set(live) - set(tensors)), sorted(set(tensors) - set(live))
                raise RefusedInput(409, f"version {version}: missing tensors {missing[:5]}, unknown {unknown[:5]}")
            for name, value in tensors.items():
                if value.shape != live[name].shape or value.dtype != live[name].dtype:
                    raise RefusedInput(
                        409,
                        f"version {version}: {name} is {value.dtype} {tuple(value.shape)}, the LoRA's "
                        f"{live[name].dtype} {tuple(live[name].shape)}",
                    )
            self.versions[version] = {name: value.to(self.device) for name, value in tensors.items()}
            for old in sorted(self.versions)[: -self.max_versions]:
                del self.versions[old]
            return self._bind(version)

    def rollout(
        self, tensors: dict[str, torch.Tensor], request: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """One chunk: the rollout of ``request`` with its version bound; returns the tensors and the answer's JSON
        (version, the live parameters' SHA-256, denoiser calls, seconds)."""
        version = request["version"]
        with self._lock:
            if version not in self.versions:
                raise RefusedInput(409, f"version {version} is not held (held: {sorted(self.versions)}): publish it")
            start = time.perf_counter()
            sha256 = self._bind(version)
            generators = []
            for state in tensors["generator_states"]:
                generator = torch.Generator()
                generator.set_state(state.clone())  # (its own storage: set_state ignores a view's offset)
                generators.append(generator)
            cond = {key[5:]: value.to(self.device) for key, value in tensors.items() if key.startswith("cond.")}
            autocast = contextlib.nullcontext()
            if self.mixed_precision in ("bf16", "fp16"):
                dtype = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float16
                autocast = torch.autocast(self.device.type, dtype=dtype)
            with autocast:
                result = generate(
                    self.policy,
                    self.policy.denoiser,
                    generators,
                    cond,
                    RolloutPlan.from_dict(request["plan"]),
                    tensors["initial_noise"].to(self.device),
                    request.get("groups"),
                    keep_means=request.get("keep_means", False),
                    decode_audio=request.get("decode_audio", False),
                )
            calls = int(result.pop("denoiser_calls"))
            self.served += 1
            info = {
                "version": version,
                "sha256": sha256,
                "denoiser_calls": calls,
                "wall_s": time.perf_counter() - start,
            }
            return {key: value for key, value in result.items() if torch.is_tensor(value)}, info

    def _live(self) -> dict[str, torch.Tensor]:
        if self.policy is None:
            raise RefusedInput(409, "no handshake yet: the trainer's first request is POST /handshake")
        return trainable_tensors(self.policy.denoiser)

    @torch.no_grad()
    def _bind(self, version: int) -> str:
        live = self._live()
        for name, value in self.versions[version].items():
            live[name].copy_(value)
        return tensor_digest(self._live())


__all__ = [
    "ROLLOUT_TOKEN_ENV",
    "RolloutWorker",
    "base_fingerprint",
    "identity_differences",
    "lora_description",
    "pack",
    "sampling_identity",
    "software",
    "tensor_digest",
    "trainable_tensors",
    "unpack",
]
