"""A process that stops making progress says so: its rank, the phase it is in, for how long, and where its threads
are, long before a collective's ``ddp_timeout`` (30 minutes by default) ends the job with a message that names none.

Progress is a change of phase (:meth:`~trl_dance.trainer.performance.PerformanceLog.phase`: rollout, reward,
training, and "other" between them: evaluation, saving, collectives). Under several processes a rank stuck in a reward
or a denoiser call reports that phase, and the ranks waiting for it report where they wait.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class HangReport(TrainerCallback):
    """While ``train`` runs, a daemon thread checks every ``interval_s / 4`` (at most 5 s) how long ``performance``
    has stayed in its current phase, and logs a warning each time that reaches another ``interval_s``."""

    def __init__(self, performance, rank: int, num_processes: int, interval_s: float):
        self.performance, self.rank, self.num_processes = performance, rank, num_processes
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread()
        self._step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._stop.clear()
        self._main = threading.current_thread()  # the thread that trains
        self._thread = threading.Thread(target=self._watch, name="trl-dance-hang-report", daemon=True)
        self._thread.start()

    def on_step_end(self, args, state, control, **kwargs):
        self._step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        reported_at = None  # the phase change the last report was about, and how many intervals it covered
        count = 0
        while not self._stop.wait(min(self.interval_s / 4, 5.0)):
            phase, since = self.performance.current_phase(), self.performance.changed_at
            if since != reported_at:
                reported_at, count = since, 0
            stuck = time.monotonic() - since
            if stuck >= (count + 1) * self.interval_s:
                count += 1
                self._report(phase, stuck)

    def _report(self, phase: str, stuck: float) -> None:
        logger.warning(
            "rank %d of %d: no progress for %.0f s, in phase '%s' after step %d (hang_report_s %g). Where its threads "
            "are, innermost last:\n%s",
            self.rank,
            self.num_processes,
            stuck,
            phase,
            self._step,
            self.interval_s,
            self._stacks(),
        )

    def _stacks(self, limit: int = 6) -> str:
        """The innermost ``limit`` frames of the training thread, then of every other thread (a reward's worker)."""
        frames = sys._current_frames()
        threads = sorted(
            (t for t in threading.enumerate() if t is not threading.current_thread() and t.ident in frames),
            key=lambda thread: thread is not self._main,
        )
        parts = [
            f"{thread.name}:\n" + "".join(traceback.format_stack(frames[thread.ident], limit=limit))
            for thread in threads
        ]
        return "".join(parts).rstrip()


__all__ = ["HangReport"]
