"""Preemption: a run told to stop (SLURM's SIGTERM or `--signal` SIGUSR1, Kubernetes' SIGTERM, a first Ctrl-C)
finishes its current optimizer update, saves a complete checkpoint (pushed if `push_to_hub` says so) and ends
normally; a second signal, more than 5 s after the first, stops at once (one sooner is the same request forwarded
by a launcher).

Under several processes a signal may reach one rank only, or the ranks at different moments: after each optimizer
update they agree on whether any rank was signalled (a one-element all-reduce, microseconds beside a diffusion step),
so every rank stops after the same update and writes its share of the same checkpoint.

A run that raises (a reward's error, an out-of-memory, a non-finite loss) writes a checkpoint too where its state is
whole: one process, and the error outside an optimizer update (from its optimizer step to its end of step the weights,
optimizer, scheduler and step counter may disagree). The checkpoint holds the state after the last complete update.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
# A signal this soon after the first is the same request (a launcher forwarding it to its processes), not a second one.
REPEAT_WINDOW_S = 5.0


@dataclass
class PreemptionArguments:
    r"""
    Preemption, on every trainer's config.

    Parameters:
        save_on_preemption (`bool`, defaults to `True`): on one of `preemption_signals`, finish the current optimizer
            update, save a checkpoint at it (as `save_strategy` would, with the same files, manifest and Hub push),
            and end training; a second signal more than 5 s after the first stops at once (one sooner is the same
            request, forwarded by a launcher). Resuming from that checkpoint reproduces the
            uninterrupted run exactly, inside a round of several updates too (the checkpoint carries its rollout).
        preemption_signals (`list[str]`, defaults to `["SIGTERM", "SIGUSR1", "SIGINT"]`): the signals that ask for it
            (SLURM sends SIGTERM at preemption and `--signal=USR1@90` before the time limit; Kubernetes SIGTERM before
            its grace period; SIGINT is Ctrl-C).
        preemption_grace_s (`float` or `None`, defaults to `None`): seconds after the first signal by which training
            must have stopped with its checkpoint; past them the process exits at once (status 128 + the signal's
            number), as a second signal would, without a checkpoint. Set it below the scheduler's own grace
            (Kubernetes' `terminationGracePeriodSeconds`, 30 by default) so that a slow update ends in a clean exit
            rather than a SIGKILL; None waits for the update however long it takes.
        save_on_crash (`bool`, defaults to `True`): when training raises (a reward's error, out of memory, a
            non-finite loss), write `checkpoint-N` at the last complete optimizer update N before the error propagates,
            unless one is there: on one process, and where the error came outside an optimizer update (from its
            optimizer step to its end of step the state is not whole, and nothing is written). The trainer's counters
            and generators go back to their values at update N; the round's rollout, reward statistics and any
            auxiliary model (DMD's fake score) are as the error left them, so resuming continues from a valid state
            but is not promised bit-identical (a preemption or a scheduled save is). With several processes nothing
            is written: the other ranks cannot join the save (the launcher stops them).
        hang_report_s (`float` or `None`, defaults to `600`): a process that stays this long in one phase (rollout,
            reward, training, or "other" between them: evaluation, saving, a collective) logs its rank, the phase, the
            step and where its main thread is, again after each further interval
            (:class:`~trl_dance.trainer.hang_report.HangReport`): a rank stuck in a reward or a collective is named long
            before `ddp_timeout` (1800 s) ends the job. Set it above the longest phase a healthy run has (a large
            evaluation); None: never.
    """

    save_on_preemption: bool = field(
        default=True, metadata={"help": "On SIGTERM/SIGUSR1/Ctrl-C: finish the update, save a checkpoint, stop."}
    )
    preemption_signals: list[str] = field(
        default_factory=lambda: list(SIGNALS), metadata={"help": "Signals that ask for a checkpoint and a stop."}
    )
    preemption_grace_s: float | None = field(
        default=None,
        metadata={"help": "Seconds after a preemption signal by which training must have stopped (None: no limit)."},
    )
    hang_report_s: float | None = field(
        default=600.0,
        metadata={"help": "Seconds in one phase after which a process logs its rank, phase and stack (None: never)."},
    )
    save_on_crash: bool = field(
        default=True,
        metadata={"help": "When training raises: a checkpoint at the last complete optimizer update (one process)."},
    )

    def _check_preemption(self) -> None:
        if self.preemption_grace_s is not None and not self.preemption_grace_s > 0:
            raise ValueError(f"preemption_grace_s must be > 0 seconds (or None), got {self.preemption_grace_s}")
        if self.hang_report_s is not None and not self.hang_report_s > 0:
            raise ValueError(f"hang_report_s must be > 0 seconds (or None), got {self.hang_report_s}")
        unknown = [name for name in self.preemption_signals if not hasattr(signal, name)]
        if unknown:
            raise ValueError(f"preemption_signals: {unknown} are not signals of this platform ({list(SIGNALS)}, ...)")


class PreemptionHandler(TrainerCallback):
    """Catches the preemption signals while ``train`` runs (see the module docstring). ``agree(flag)`` returns
    whether any process raised its flag (the trainer's all-reduce)."""

    def __init__(self, signals: list[str], agree, grace_s: float | None = None):
        self.signals = [getattr(signal, name) for name in signals]
        self.agree, self.grace_s = agree, grace_s
        self._timer: threading.Timer | None = None
        self.requested: str | None = None  # the first signal's name
        self.stopped_by: str | None = None  # what stopped training early (a signal here, or on another process)
        self._first_at = 0.0  # and when it came (time.monotonic)
        self._previous: dict[int, object] = {}

    def _handle(self, number, frame) -> None:
        name = signal.Signals(number).name
        if self.requested is not None and time.monotonic() - self._first_at < REPEAT_WINDOW_S:
            # The same request reaching us twice: a launcher (torchrun's agent) forwarding what the scheduler sent to
            # the whole job step, or a Ctrl-C that reached the process group twice.
            return
        if self.requested is not None:  # the second: stop now, as the signal would have without us
            logger.warning("%s again: stopping at once, without a checkpoint", name)
            self._restore()
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(number)  # to the handler that was there before (SIGTERM's default: exit)
            return
        self.requested, self._first_at = name, time.monotonic()
        if self.grace_s is not None:
            self._timer = threading.Timer(self.grace_s, self._expire, args=(number,))
            self._timer.daemon = True
            self._timer.start()
        logger.warning(
            "%s received: finishing the current optimizer update, then saving a checkpoint and stopping (send it "
            "again to stop at once)",
            name,
        )

    def _expire(self, number: int) -> None:
        """The grace is over and training has not stopped: exit now (from the timer's thread), as the signal would."""
        logger.error(
            "%s: training did not stop within preemption_grace_s=%s s; exiting without a checkpoint",
            signal.Signals(number).name,
            self.grace_s,
        )
        logging.shutdown()
        os._exit(128 + number)

    def _restore(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.requested = self.stopped_by = None
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            logger.warning("training runs outside the main thread: preemption signals are not caught")
            return
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        if self.agree(self.requested is not None):
            logger.warning("stopping at step %d after a preemption signal: saving a checkpoint", state.global_step)
            self.stopped_by = self.requested or "a preemption signal on another process"
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._timer is not None:  # stopped in time
            self._timer.cancel()
            self._timer = None
        self._restore()


def any_process(accelerator, flag: bool) -> bool:
    """Whether ``flag`` is true on any process (an all-reduce of one number; no collective on one process)."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([float(flag)], device=accelerator.device)
    return bool(accelerator.reduce(value, "sum").item() > 0)


class UpdateBoundary(TrainerCallback):
    """Whether the trained state is whole (``inside`` False: between an update's end of step and the next optimizer
    step) and ``state``, the trainer's ``snapshot()`` taken at the last end of step (its counters and generators)."""

    def __init__(self, snapshot):
        self.snapshot = snapshot
        self.inside, self.hooked, self.state = False, False, {}
        self._hook = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.inside, self.state = False, self.snapshot()
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's
        self.hooked = isinstance(inner, torch.optim.Optimizer)
        if self.hooked:
            self._hook = inner.register_step_pre_hook(self._entering)

    def _entering(self, optimizer, args, kwargs) -> None:
        self.inside = True

    def on_step_end(self, args, state, control, **kwargs):
        self.inside, self.state = False, self.snapshot()

    def on_train_end(self, args, state, control, **kwargs):
        self.remove()

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


__all__ = ["PreemptionArguments", "PreemptionHandler", "UpdateBoundary", "any_process"]
