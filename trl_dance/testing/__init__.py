"""Tiny, random-weight diffusers pipelines built fully offline, for tests, demos and CPU benchmarks.

Each builder returns a real diffusers pipeline in float32 on CPU, in eval mode, deterministic for a given seed,
with tokenizers built in memory. Saved with ``save_pretrained`` they load back through the ordinary
``<Pipeline>.from_pretrained(path)``, the path users take with Hub ids::

    python -m trl_dance.testing flux ./tiny-flux        # writes a FluxPipeline folder
    python -m trl_dance.testing wan-i2v ./tiny-wan-i2v --image-prompts ./i2v-prompts   # + prompts with images

Images are 32×32 and Wan videos 5 frames of 32×32 (the VAEs downsample by 2); one 8-step generation takes a fraction
of a second on one core.

One module per family (``flux``, ``stable_diffusion``, ``wan``, ...) on shared ``components``; ``folders`` saves
them; :mod:`trl_dance.tiny_folders` is what production code needs of a saved one (recognising and loading it).
"""

from __future__ import annotations

from ..tiny_folders import TINY_SAMPLING, TINY_SAMPLING_FILE, load_tiny_pipeline
from .components import TINY_RESOLUTION, TINY_VIDEO_FRAMES
from .flux import (
    flux_scheduler,
    tiny_flux2_klein_pipeline,
    tiny_flux2_pipeline,
    tiny_flux_kontext_pipeline,
    tiny_flux_pipeline,
)
from .folders import (
    TINY_PIPELINES,
    main,
    save_image_prompts,
    save_tiny_pipeline,
    tiny_condition_images,
    tiny_preference_dataset,
)
from .hunyuan_video import (
    hunyuan_video_scheduler,
    tiny_hunyuan_video15_i2v_pipeline,
    tiny_hunyuan_video15_pipeline,
    tiny_hunyuan_video_pipeline,
    tiny_skyreels_i2v_pipeline,
)
from .ltx2 import (
    LTX2_TINY_REGISTERS,
    ltx2_scheduler,
    tiny_ltx2_condition_pipeline,
    tiny_ltx2_i2v_pipeline,
    tiny_ltx2_pipeline,
)
from .qwen_image import (
    qwen_image_scheduler,
    tiny_qwen_image21_pipeline,
    tiny_qwen_image_edit_pipeline,
    tiny_qwen_image_edit_plus_pipeline,
    tiny_qwen_image_pipeline,
)
from .stable_diffusion import (
    sd15_scheduler,
    sd21_scheduler,
    sdxl_scheduler,
    tiny_sd2_pipeline,
    tiny_sd3_pipeline,
    tiny_sd_pipeline,
    tiny_sdxl_pipeline,
)
from .wan import (
    tiny_wan22_5b_i2v_pipeline,
    tiny_wan22_5b_pipeline,
    tiny_wan22_i2v_pipeline,
    tiny_wan22_pipeline,
    tiny_wan_flf2v_pipeline,
    tiny_wan_i2v_pipeline,
    tiny_wan_pipeline,
    wan_scheduler,
)
from .z_image import tiny_z_image_pipeline

__all__ = [
    "LTX2_TINY_REGISTERS",
    "TINY_PIPELINES",
    "TINY_RESOLUTION",
    "TINY_SAMPLING",
    "TINY_SAMPLING_FILE",
    "TINY_VIDEO_FRAMES",
    "flux_scheduler",
    "hunyuan_video_scheduler",
    "load_tiny_pipeline",
    "ltx2_scheduler",
    "main",
    "qwen_image_scheduler",
    "save_image_prompts",
    "save_tiny_pipeline",
    "sd15_scheduler",
    "sd21_scheduler",
    "sdxl_scheduler",
    "tiny_condition_images",
    "tiny_flux2_klein_pipeline",
    "tiny_flux2_pipeline",
    "tiny_flux_kontext_pipeline",
    "tiny_flux_pipeline",
    "tiny_hunyuan_video15_i2v_pipeline",
    "tiny_hunyuan_video15_pipeline",
    "tiny_hunyuan_video_pipeline",
    "tiny_ltx2_condition_pipeline",
    "tiny_ltx2_i2v_pipeline",
    "tiny_ltx2_pipeline",
    "tiny_preference_dataset",
    "tiny_qwen_image21_pipeline",
    "tiny_qwen_image_edit_pipeline",
    "tiny_qwen_image_edit_plus_pipeline",
    "tiny_qwen_image_pipeline",
    "tiny_sd2_pipeline",
    "tiny_sd3_pipeline",
    "tiny_sd_pipeline",
    "tiny_sdxl_pipeline",
    "tiny_skyreels_i2v_pipeline",
    "tiny_wan22_5b_i2v_pipeline",
    "tiny_wan22_5b_pipeline",
    "tiny_wan22_i2v_pipeline",
    "tiny_wan22_pipeline",
    "tiny_wan_flf2v_pipeline",
    "tiny_wan_i2v_pipeline",
    "tiny_wan_pipeline",
    "tiny_z_image_pipeline",
    "wan_scheduler",
]
