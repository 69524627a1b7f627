"""Make ``import torchvision`` work where its compiled operators cannot load (imported first by ``trl_dance``).

PyPI's Linux torchvision wheels link CUDA torch's libraries, so beside a CPU-only torch build their ``_C`` extension
does not load. torchvision guards every use of those operators but two: its import registers fake kernels for
``torchvision::nms`` and ``qnms`` unconditionally and fails ("operator torchvision::nms does not exist"), and so does
every transformers import once torchvision is installed. Declaring the two schemas first lets it import; its operators
(box NMS, RoI ops) stay unavailable and raise if called, while its models and transforms (what EasyOCR, open_clip,
HPSv2 and ImageReward use) work. An environment without torchvision, or whose torchvision loads, is left alone.
"""

from __future__ import annotations

import importlib.util
import os


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
