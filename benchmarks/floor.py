"""The compute floor of a training run: the bare model calls it made, recorded during the run and replayed alone.

A :class:`CallRecorder` hooks the denoiser, the VAE's ``encode``/``decode``, the text encodes (the pipeline's own
``encode_prompt``: tokenizers and text encoders, as any diffusers user runs them) and the reward functions of a
trainer. Every call made while recording is counted under (phase, module, grad mode, input
shapes) with one copy of its inputs; :meth:`CallRecorder.floor_seconds` then replays each distinct call as many
times as it happened: denoiser calls made with gradients as forward + backward, everything else as a forward
under ``no_grad``. The floor therefore has exactly the run's shapes, dtypes, LoRA layers and gradient
checkpointing, and none of its Python, sampling, loss, optimizer or data-loading work.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in sorted(value.items()))
    return len(value) if isinstance(value, str) else None


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    return _first_tensor(output[0])


def _replay(grad: bool, target: Callable, args: tuple, kwargs: dict) -> None:
    """One recorded call again: forward + backward where the run had gradients, else a forward under no_grad."""
    if grad:
        _first_tensor(target(*args, **kwargs)).float().mean().backward()
    else:
        with torch.no_grad():
            target(*args, **kwargs)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CallRecorder:
    """Records the model calls of a trainer (see the module docstring). ``phase`` is set by the caller."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.enabled = False
        self.phase = "train"
        self.calls: dict[tuple, list] = {}  # key -> [count, callable, args, kwargs]
        policy = trainer.policy
        self._handle = policy.denoiser.register_forward_pre_hook(self._hook("denoiser"), with_kwargs=True)
        self._patched: list[tuple[Any, str]] = []  # (object, attribute) wrapped in place
        self._patch(policy, "_encode", "text_encode")
        for method in ("encode", "decode"):
            self._patch(policy.pipeline.vae, method, f"vae.{method}")
        if hasattr(trainer, "reward_funcs"):
            trainer.reward_funcs = [self._wrap(f"reward.{i}", f) for i, f in enumerate(trainer.reward_funcs)]

    def _patch(self, owner: Any, attribute: str, name: str) -> None:
        if attribute in vars(owner):
            raise RuntimeError(f"{name} is already wrapped")
        setattr(owner, attribute, self._wrap(name, getattr(owner, attribute)))
        self._patched.append((owner, attribute))

    def remove(self) -> None:
        """Unhook the denoiser and unwrap the pipeline's methods (the pipeline may serve another run)."""
        self._handle.remove()
        for owner, attribute in self._patched:
            delattr(owner, attribute)

    def _record(self, name: str, target: Callable, args: tuple, kwargs: dict) -> None:
        if not self.enabled:
            return
        grad = torch.is_grad_enabled() and name == "denoiser"
        key = (self.phase, name, grad, _signature(args), _signature(kwargs))
        if key in self.calls:
            self.calls[key][0] += 1
        else:
            self.calls[key] = [1, target, _detach(args), _detach(kwargs)]

    def _hook(self, name: str):
        def hook(module, args, kwargs):
            self._record(name, module, args, kwargs)

        return hook

    def _wrap(self, name: str, func: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            self._record(name, func, args, kwargs)
            return func(*args, **kwargs)

        wrapped.__name__ = getattr(func, "__name__", name)
        return wrapped

    def floor_seconds(self, repeats: int = 3) -> dict[str, dict[str, float]]:
        """Seconds of the replayed calls by phase and module (``{"rollout": {"denoiser": s, ...}, ...}``); each
        distinct call is replayed ``count`` times, the median of ``repeats`` (as robust to noise as the run's own
        median step time it is compared with)."""
        self.enabled = False
        device = self.trainer.accelerator.device
        seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for (phase, name, grad, *_), (count, target, args, kwargs) in self.calls.items():
            times = []
            for _ in range(repeats):
                synchronize(device)
                start = time.perf_counter()
                for _ in range(count):
                    _replay(grad, target, args, kwargs)
                synchronize(device)
                times.append(time.perf_counter() - start)
            seconds[phase][name.split(".")[0] if name.startswith("reward") else name] += statistics.median(times)
        self.trainer.model.zero_grad(set_to_none=True)
        return {phase: dict(by_name) for phase, by_name in seconds.items()}

    def flops(self) -> float:
        """Model FLOPs of all recorded calls (torch's FlopCounterMode, one replay of each distinct call × count)."""
        from trl_dance.flops import torch_flop_counter

        total = 0.0
        for (_, _, grad, *_), (count, target, args, kwargs) in self.calls.items():
            with torch_flop_counter(display=False) as counter:
                _replay(grad, target, args, kwargs)
            total += counter.get_total_flops() * count
        self.trainer.model.zero_grad(set_to_none=True)
        return total

    def count(self, name: str) -> int:
        return sum(entry[0] for key, entry in self.calls.items() if key[1] == name)


def peak_tflops(device: torch.device) -> float | None:
    """The accelerator's dense bf16 peak (TRL's table, as the trainers' perf/mfu)."""
    from trl_dance.trainer.performance import peak_tflops as lookup

    return lookup(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def peak_memory_mb(device: torch.device) -> float:
    """Peak ``torch.cuda.max_memory_allocated`` on a GPU; peak process RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
