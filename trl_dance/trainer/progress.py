"""The progress bar of the online trainers: rounds (what a user counts: sampled, scored, trained), with the optimizer
updates as a postfix. transformers' bar counts updates, and a method with several updates a round (ART, RTDMD) read
30/30 after 15 rounds."""

from __future__ import annotations

from tqdm.auto import tqdm
from transformers import ProgressCallback

from .async_rounds import rounds_in_run


class RoundProgressCallback(ProgressCallback):
    """transformers' :class:`~transformers.ProgressCallback` counting rounds of ``updates_per_round`` updates each."""

    def __init__(self, updates_per_round: int, max_str_len: int = 100):
        super().__init__(max_str_len)
        self.updates_per_round = updates_per_round

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            total = rounds_in_run(state.max_steps, self.updates_per_round)
            self.training_bar = tqdm(total=total, unit="round", dynamic_ncols=True, initial=self._rounds(state))
            self._postfix(state)
        self.current_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar.update(self._rounds(state) - self.training_bar.n)
            self._postfix(state)
            self.current_step = state.global_step

    def _rounds(self, state) -> int:
        """Rounds finished: a round ends with its last update (the last round of a run may be cut short)."""
        done = state.global_step // self.updates_per_round
        return done + (state.global_step == state.max_steps and state.global_step % self.updates_per_round > 0)

    def _postfix(self, state) -> None:
        if self.updates_per_round > 1:
            self.training_bar.set_postfix_str(f"updates {state.global_step}/{state.max_steps}", refresh=False)


def use_round_progress(callback_handler, updates_per_round: int) -> None:
    """Swap the stock progress bar (where there is one: not with ``disable_tqdm``; a notebook's keeps its table) for
    :class:`RoundProgressCallback`."""
    stock = [c for c in callback_handler.callbacks if type(c) is ProgressCallback]
    for callback in stock:
        callback_handler.remove_callback(callback)
        callback_handler.add_callback(RoundProgressCallback(updates_per_round, callback.max_str_len))


__all__ = ["RoundProgressCallback", "use_round_progress"]
