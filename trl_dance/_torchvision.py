"""Make ``import torchvision`` work where its compiled operators cannot load.

PyPI's Linux torchvision wheels link CUDA torch's libraries, so beside a CPU-only torch build their ``_C`` extension
does not load. torchvision guards every use of those operators but two: its import registers fake kernels for
``torchvision::nms`` and ``qnms`` unconditionally and fails ("operator torchvision::nms does not exist"), and so does
every transformers import once torchvision is installed. Declaring the two schemas first lets it import; its operators
(box NMS, RoI ops) stay unavailable and raise if called, while its models and transforms (what EasyOCR, open_clip,
HPSv2 and ImageReward use) work. An environment without torchvision, or whose torchvision loads, is left alone.

:func:`install_import_hook` applies it at the first ``import torchvision`` (no cost before: torch is not even
imported). ``import trl_dance`` installs the hook, and so does a ``.pth`` file that ``scripts/setup_env.sh`` writes
into the virtual environment it creates, so that scripts importing transformers before trl_dance work too. This
module imports nothing of trl_dance's.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys


def allow_torchvision_without_operators() -> bool:
    """Declare torchvision's two unguarded operator schemas if its extension cannot load; returns whether it did."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    library = os.path.join(next(iter(spec.submodule_search_locations)), "_C.so")
    if not os.path.isfile(library):
        return False
    import torch

    if torch._C._dispatch_has_kernel("torchvision::nms"):  # loaded, or declared already
        return False
    try:
        torch.ops.load_library(library)
        return False
    except (OSError, RuntimeError):
        pass
    for name in ("nms", "qnms"):
        torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs :func:`allow_torchvision_without_operators` when ``torchvision`` is first imported, then steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            allow_torchvision_without_operators()
        return None  # the regular finders import it


def install_import_hook() -> None:
    """Apply :func:`allow_torchvision_without_operators` at the first ``import torchvision`` (cheap until then)."""
    if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
