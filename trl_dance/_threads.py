"""OpenMP's wait policy, set before torch loads.

OpenMP's default wait keeps torch's idle threads spinning after each parallel region, against the other threads of
this program (reward scoring, data loading) and every other process on the cores: the README's example ran 36x slower
on a loaded 2-core machine. libgomp reads the policy once, when torch loads it: it is set here, on the package's first
import, if torch is not loaded yet (the user's own setting wins); otherwise a CPU trainer says how to set it
(:func:`trl_dance.trainer.diffusion_trainer.warn_if_threads_spin`). No torch import here.
"""

import os
import sys

OMP_SPINS = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
"""Whether torch loaded OpenMP before trl_dance without ``OMP_WAIT_POLICY`` (its threads then spin)."""
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
