"""FLOPs of denoiser calls in closed form: what every forward, backward and activation-checkpointing recomputation of
a trainer's denoiser costs, without running anything.

A denoiser is a list of matrix products ("ops"): linear layers (``2·rows·in·out``), convolutions
(``2·rows·C_out·C_in/groups·kernel``) and attention cores (``4·B·L_q·L_kv·inner``: ``QKᵀ`` and ``PV``). The rows of
an op are the batch times the tokens of the *stream* it reads, and a family says which stream each module reads
(:class:`FlopLayout`: image or video tokens, text tokens, the per-sample embeddings that modulate the blocks, a UNet's
resolution levels). LoRA's ``lora_A``/``lora_B`` are linear layers of their parent's stream, counted while the
adapter is enabled; CFG doubles the batch the denoiser sees. Norms, activations and RoPE are not matrix products and,
as in torch's :class:`~torch.utils.flop_counter.FlopCounterMode`, are not counted.

A backward costs, per op, its forward once for the weight gradient when the weight trains and once for the input
gradient when its input requires a gradient (attention: twice when any of q, k, v does), which is what autograd
computes: a full fine-tune's backward is ≈ 2× its forward, a LoRA's ≈ 1×. Which inputs require a gradient depends on
where the trained parameters sit, so :class:`DenoiserFlops` records it from the first call with gradients (hooks,
run eager, on the calls made until their backward has run), together with the blocks that activation checkpointing
recomputes in the backward.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.utils import flop_counter

SAMPLE = "sample"
"""The stream of per-sample vectors (timestep, guidance and pooled-text embeddings, AdaLN modulation): one row per
sample, or per token for models that embed a timestep per token (Wan 2.2 TI2V)."""

_LORA_SUFFIX = re.compile(r"\.(base_layer|lora_[AB]\.[^.]+|lora_embedding_[AB]\.[^.]+)$")


@dataclass(frozen=True)
class FlopLayout:
    """Which tokens each module of a family's denoiser reads.

    Args:
        streams: ``(pattern, stream)`` pairs: a linear or convolution whose module path matches ``pattern``
            (``re.search``; LoRA sub-layers go by their parent's path) reads ``stream``, the first match wins, and
            unmatched modules read ``default``. A stream ``"a+b"`` is the concatenation of two (joint blocks).
        attention: ``(pattern, query_stream, key_stream)`` for the attention modules (those with a ``processor``).
        default: the stream of unmatched modules.
    """

    streams: tuple[tuple[str, str], ...] = ()
    attention: tuple[tuple[str, str, str], ...] = ()
    default: str = "image"

    def stream(self, name: str) -> str:
        name = _LORA_SUFFIX.sub("", name)
        return next((stream for pattern, stream in self.streams if re.search(pattern, name)), self.default)

    def attention_streams(self, name: str) -> tuple[str, str]:
        for pattern, query, key in self.attention:
            if re.search(pattern, name):
                return query, key
        raise ValueError(f"no attention streams for {name!r}; add a pattern to the family's FlopLayout")


@dataclass
class Op:
    """One matrix product of a forward: ``flops = batch · coefficient · tokens(stream) [· tokens(key_stream)]``."""

    name: str
    kind: str  # "linear" | "conv" | "attention"
    coefficient: int
    stream: str
    key_stream: str | None = None
    trains: bool = False
    lora: bool = False
    module: torch.nn.Module | None = field(default=None, repr=False)

    def flops(self, tokens: Mapping[str, int], batch: int) -> float:
        count = batch * self.coefficient * stream_tokens(tokens, self.stream)
        return count * stream_tokens(tokens, self.key_stream) if self.key_stream else count


def stream_tokens(tokens: Mapping[str, int], stream: str) -> int:
    """Tokens of ``stream`` (``"a+b"`` sums), from the per-sample counts ``tokens`` (a missing stream has 0)."""
    return sum(tokens.get(part, 0) for part in stream.split("+"))


def denoiser_ops(model: torch.nn.Module, layout: FlopLayout) -> list[Op]:
    """The matrix products of ``model``'s forward in module order (linear, convolution and attention modules)."""
    ops = []
    for name, module in model.named_modules():
        trains = any(p.requires_grad for p in module.parameters(recurse=False))
        lora = bool(re.search(r"\.lora_[AB]\.", name))
        if isinstance(module, torch.nn.Linear):
            coefficient = 2 * module.in_features * module.out_features
            ops.append(Op(name, "linear", coefficient, layout.stream(name), None, trains, lora, module))
        elif isinstance(module, torch.nn.modules.conv._ConvNd):
            kernel = math.prod(module.kernel_size)
            coefficient = 2 * module.out_channels * module.in_channels // module.groups * kernel
            ops.append(Op(name, "conv", coefficient, layout.stream(name), None, trains, lora, module))
        elif hasattr(module, "processor"):  # an attention module
            query, key = layout.attention_streams(name)
            ops.append(Op(name, "attention", 4 * _inner_dim(module), query, key, False, False, module))
    return ops


def forward_flops(model: torch.nn.Module, layout: FlopLayout, tokens: Mapping[str, int], batch: int = 1) -> float:
    """FLOPs of one forward of ``model`` (any device, ``meta`` included: nothing runs) on ``batch`` samples with the
    per-sample stream ``tokens``."""
    return float(sum(op.flops(tokens, batch) for op in denoiser_ops(model, layout)))


def denoiser_tokens(inputs: Mapping[str, object], config) -> dict[str, int]:
    """Per-sample token counts of a denoiser call with named ``inputs`` (a transformer's or UNet's keyword arguments)
    for a model of ``config``: ``image`` (video) tokens after patching, ``text`` tokens, ``image_embeds`` (an image
    encoder's tokens, Wan I2V), and :data:`SAMPLE` rows (1, or one per token where the timestep is per token)."""
    hidden = inputs.get("hidden_states", inputs.get("sample"))
    patch = config.get("patch_size") or 1
    if hidden.dim() == 3:  # packed tokens (FLUX, Qwen-Image)
        image = hidden.shape[1]
    elif hidden.dim() == 4:  # (B, C, H, W)
        image = (hidden.shape[2] // patch) * (hidden.shape[3] // patch)
    else:  # (B, C, F, H, W)
        patch_t, patch_h, patch_w = (
            patch if isinstance(patch, (list, tuple)) else (config.get("patch_size_t") or 1, patch, patch)
        )
        image = (hidden.shape[2] // patch_t) * (hidden.shape[3] // patch_h) * (hidden.shape[4] // patch_w)
    tokens = {"image": image, SAMPLE: inputs["timestep"][0].numel()}
    for stream, name in (("text", "encoder_hidden_states"), ("image_embeds", "encoder_hidden_states_image")):
        if isinstance(inputs.get(name), torch.Tensor):  # (rows of several per sample: Wan FLF2V's two images)
            tokens[stream] = inputs[name].shape[1] * (inputs[name].shape[0] // hidden.shape[0])
    return tokens


def _tensors(output) -> list[torch.Tensor]:
    """The tensors in a call's output: a tensor, or tuples, lists and dicts (``ModelOutput``) of them (Z-Image
    returns a list per sample)."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return [tensor for value in values for tensor in _tensors(value)]


def _inner_dim(attention: torch.nn.Module) -> int:
    """Heads × head dimension of an attention module (its query width)."""
    if isinstance(getattr(attention, "inner_dim", None), int):
        return attention.inner_dim
    heads, head_dim = getattr(attention, "heads", None), getattr(attention, "head_dim", None)
    if heads and head_dim:
        return heads * head_dim
    return attention.to_q.out_features


@dataclass
class CallFlops:
    """FLOPs of one denoiser call: its forward, and with gradients its backward and checkpointing recomputation."""

    forward: float
    backward: float = 0.0
    recompute: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


class DenoiserFlops:
    """Counts the FLOPs of every call of a denoiser (attach it once; the trainer reads :meth:`take` at each log).

    The count comes from the call's input shapes (a forward pre-hook, no device work): ``tokens(inputs)`` gives the
    per-sample token counts of the layout's streams from the call's named inputs, and the batch is the first
    dimension of its first tensor input. ``scale`` multiplies every count (context parallelism: each of C ranks does
    1/C of the group's work).
    """

    def __init__(
        self,
        layout: FlopLayout,
        tokens: Callable[[Mapping[str, object]], dict[str, int]],
        scale: float = 1.0,
    ):
        self.layout, self.tokens, self.scale = layout, tokens, scale
        self.by_phase: dict[str, float] = defaultdict(float)  # FLOPs counted since the last take, by phase
        self.phase: Callable[[], str] = lambda: "other"  # the phase a call belongs to (the trainer's PerformanceLog)
        self._handles: list = []
        self._models: dict[int, _Counted] = {}

    def attach(self, model: torch.nn.Module) -> DenoiserFlops:
        """Count the calls of ``model`` (the unwrapped denoiser, or a frozen copy of one)."""
        if id(model) not in self._models:
            counted = _Counted(model, self.layout)
            self._models[id(model)] = counted
            self._handles.append(model.register_forward_pre_hook(self._hook(counted), with_kwargs=True))
        return self

    def remove(self) -> None:
        for counted in self._models.values():
            counted.finish_probe()
        for handle in self._handles:
            handle.remove()
        self._handles, self._models = [], {}

    def take(self) -> float:
        """FLOPs counted since the last call; call it after the backward of the calls to count (a log step)."""
        return sum(self.take_by_phase().values())

    def take_by_phase(self) -> dict[str, float]:
        """As :meth:`take`, by the phase (``self.phase()`` at each call: rollout, training, ...) the calls ran in."""
        for counted in self._models.values():
            for phase, flops in counted.finish_probe().items():
                self.by_phase[phase] += self.scale * flops
        taken, self.by_phase = dict(self.by_phase), defaultdict(float)
        return taken

    def _hook(self, counted: _Counted):
        @torch.compiler.disable  # host-side bookkeeping: never traced into a compiled denoiser
        def hook(model, args, kwargs):
            grad = torch.is_grad_enabled() and counted.trains
            if grad and counted.backward is None:
                counted.probe()
            call, phase = counted.shape(self.tokens, args, kwargs), self.phase()
            if counted.pending is not None:  # counted once the probe has seen the backward
                counted.pending.append((phase, (*call, grad)))
            else:
                self.by_phase[phase] += self.scale * counted.flops(*call, grad).total

        return hook


class _Counted:
    """One counted model: its ops and what its first call with gradients showed (which ops have a backward and which
    of those differentiate their input, which ops activation checkpointing reruns)."""

    def __init__(self, model: torch.nn.Module, layout: FlopLayout):
        self.model = model
        self.ops = denoiser_ops(model, layout)
        self.trains = any(p.requires_grad for p in model.parameters())
        self.backward: dict[str, int] | None = None  # op -> products of its backward (see probe)
        self.recomputed: set[str] = set()
        self.lora_layer = next((m for m in model.modules() if isinstance(m, BaseTunerLayer)), None)
        self._signature = inspect.signature(model.forward)
        self._cache: dict[tuple, CallFlops] = {}
        self._probe_handles: list = []
        self._stance = None  # torch.compiler.set_stance while watched code runs eager
        self.pending: list[tuple] | None = None  # calls made while probing: (phase, (tokens, batch, lora_on, grad))
        self.probed: dict[str, float] = defaultdict(float)  # their FLOPs once the probe has ended, by phase

    def shape(self, tokens: Callable, args: tuple, kwargs: dict) -> tuple[dict[str, int], int, bool]:
        """The per-sample stream tokens, the batch and whether the LoRA adapter is on, of a call."""
        inputs = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        batch = next(v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0).shape[0]
        lora_on = self.lora_layer is None or not self.lora_layer.disable_adapters
        return tokens(inputs), batch, lora_on

    def flops(self, tokens: dict[str, int], batch: int, lora_on: bool, grad: bool) -> CallFlops:
        key = (tuple(sorted(tokens.items())), batch, grad, lora_on)
        if key not in self._cache:
            self._cache[key] = self._compute(tokens, batch, grad, lora_on)
        return self._cache[key]

    def _compute(self, tokens: dict[str, int], batch: int, grad: bool, lora_on: bool) -> CallFlops:
        result = CallFlops(0.0)
        for op in self.ops:
            if op.lora and not lora_on:
                continue
            flops = op.flops(tokens, batch)
            result.forward += flops
            if grad:
                result.backward += flops * self.backward.get(op.name, 0)
                result.recompute += flops * (op.name in self.recomputed)
        return result

    def probe(self) -> None:
        """Watch the calls from now until the backward through each of them has run (or to :meth:`finish_probe`):
        an op has a backward if its output receives a gradient, costing (as autograd computes it) one product for its
        weight's gradient if the weight trains, one for its input's if the input requires a gradient, and for
        attention 2.5 forwards (torch's count: QKᵀ is recomputed); an op that runs again after the forward has
        returned is rerun by activation checkpointing (whose early stop skips the products whose outputs the backward
        does not need). The calls' FLOPs wait for the end of the probe.

        Watched calls and the backward through them run eager (``torch.compiler.set_stance("force_eager")``):
        dynamo traces a module's hooks into its compiled graph, as graph breaks at every watched op, and does not
        guard on hooks, so a block compiled while they were attached would stay in pieces for the whole run once they
        are gone (a tiny FLUX's compiled GRPO round: 532 graph calls instead of 32)."""
        self.backward, self.recomputed = {}, set()
        self._cache.clear()
        # Called from the root's pre-hook: the first call is starting. Watched calls with gradients count up.
        state = {"forward": True, "queued": False, "calls": 0}
        outstanding: set[int] = set()  # watched calls whose backward has not begun
        inputs_live: set[str] = set()
        handles = []

        def before(op: Op):
            @torch.compiler.disable
            def hook(module, args, kwargs):
                if not state["forward"]:
                    return
                tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
                if op.kind == "attention":
                    live = any(t.requires_grad for t in tensors) or any(p.requires_grad for p in module.parameters())
                else:
                    live = bool(tensors) and tensors[0].requires_grad
                if live:
                    inputs_live.add(op.name)

            return hook

        def after(op: Op):
            @torch.compiler.disable
            def hook(module, args, output):
                if not state["forward"]:  # completed again in the backward (early stop may end before an op)
                    self.recomputed.add(op.name)
                    return
                output = output[0] if isinstance(output, (tuple, list)) else output
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(lambda grad: self.backward.__setitem__(op.name, products(op)))

            return hook

        def products(op: Op) -> float:
            if op.kind == "attention":
                return 2.5 * (op.name in inputs_live)
            return op.trains + (op.name in inputs_live)

        def backward_started(call: int, grad) -> None:
            # The backward through watched call ``call`` has begun: eager until that backward pass (checkpointing's
            # recomputation included) has run; the probe ends after the last watched call's.
            if call in outstanding:
                outstanding.discard(call)
                self._eager(True)
                if not state["queued"]:
                    state["queued"] = True
                    torch.autograd.Variable._execution_engine.queue_callback(backward_done)

        def backward_done() -> None:
            state["queued"] = False
            self._eager(False)
            if not outstanding:
                self.end_probe()

        @torch.compiler.disable
        def enter(module, args):
            state["forward"] = True
            self._eager(True)

        @torch.compiler.disable
        def leave(module, args, output):
            state["forward"] = False
            self._eager(False)
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if tensors:
                call = state["calls"] = state["calls"] + 1
                outstanding.add(call)
                for tensor in tensors:
                    tensor.register_hook(functools.partial(backward_started, call))

        for op in self.ops:
            handles.append(op.module.register_forward_pre_hook(before(op), with_kwargs=True))
            handles.append(op.module.register_forward_hook(after(op)))
        handles += [self.model.register_forward_pre_hook(enter), self.model.register_forward_hook(leave)]
        self._probe_handles, self.pending = handles, []
        self._eager(True)  # (this call's pre-hooks were read before ``enter`` was added)

    def _eager(self, on: bool) -> None:
        """Run compiled code eager (``on``) or as before."""
        if on and self._stance is None:
            self._stance = torch.compiler.set_stance("force_eager")
        elif not on and self._stance is not None:
            self._stance.__exit__(None, None, None)  # the stance from before
            self._stance = None

    def end_probe(self) -> None:
        """Stop watching (idempotent): remove the hooks, compile again, and count the calls made while watching."""
        if self.pending is None:
            return
        for handle in self._probe_handles:
            handle.remove()
        self._eager(False)
        calls, self.pending, self._probe_handles = self.pending, None, []
        self._cache.clear()
        for phase, call in calls:
            self.probed[phase] += self.flops(*call).total

    def finish_probe(self) -> dict[str, float]:
        """End the probe if it is still on (its calls' backwards have run): the FLOPs of the calls made during it, by
        phase, not yet taken."""
        self.end_probe()
        probed, self.probed = dict(self.probed), defaultdict(float)
        return probed


def _cpu_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward_flops(grad_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return flop_counter.sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)


# torch's FlopCounterMode has no formula for the CPU flash-attention kernel that scaled_dot_product_attention runs on
# a CPU, so it counts attention as 0 there; the CUDA kernels' formulas make counts compare. Passed to one counter
# (`custom_mapping`), never registered in torch's global table: importing trl_dance changes no other program's counts.
TORCH_FLOP_FORMULAS: dict = {
    op: formula
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_attention_flops),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_attention_backward_flops),
    )
    if (op := getattr(torch.ops.aten, name, None)) is not None and op not in flop_counter.flop_registry
}
"""Formulas for ``FlopCounterMode(custom_mapping=...)``: the ops torch's table lacks that the trainers run on a CPU."""


def torch_flop_counter(**kwargs) -> flop_counter.FlopCounterMode:
    """torch's ``FlopCounterMode(**kwargs)`` with :data:`TORCH_FLOP_FORMULAS`: the reference these closed forms are
    checked against, counting attention on a CPU too."""
    return flop_counter.FlopCounterMode(custom_mapping={**TORCH_FLOP_FORMULAS, **kwargs.pop("custom_mapping", {})},
                                        **kwargs)  # fmt: skip
