"""Words rendered as images with the TrueType fonts matplotlib ships (no download): the text task's training data
and its ground truth."""

from __future__ import annotations

import functools
import os
import random

from PIL import Image, ImageDraw, ImageFont

FONTS = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
)
"""Fonts of matplotlib's ``mpl-data/fonts/ttf`` that both OCR engines read at this size (DejaVuSansDisplay's "B"
reads as "8": not used)."""

IMAGE_SIZE = 64
FONT_PIXELS = (19, 23)
"""Font size range in pixels (ink about 14-17 px tall): at 64 px, several latent pixels per glyph after a factor-2
VAE, and read by both engines once upscaled."""
MAX_SHIFT = 4
"""Largest offset of the word's centre from the image's, in pixels per axis."""


@functools.cache
def _font(name: str, pixels: int) -> ImageFont.FreeTypeFont:
    import matplotlib

    return ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", name), pixels)


def render_word(word: str, rng: random.Random | None = None, size: int = IMAGE_SIZE) -> Image.Image:
    """``word`` on a plain background, ``size`` × ``size`` RGB. With ``rng``: a random font of :data:`FONTS`, size in
    :data:`FONT_PIXELS`, offset up to :data:`MAX_SHIFT` px, dark ink on a light background of random hues; without:
    DejaVu Sans Bold at the largest size, centred, black on white (the ground truth OCR engines are checked on)."""
    if rng is None:
        font, pixels, shift, ink, paper = FONTS[1], FONT_PIXELS[1], (0, 0), (0, 0, 0), (255, 255, 255)
    else:
        font, pixels = rng.choice(FONTS), rng.randint(*FONT_PIXELS)
        shift = (rng.randint(-MAX_SHIFT, MAX_SHIFT), rng.randint(-MAX_SHIFT, MAX_SHIFT))
        ink = tuple(rng.randint(0, 90) for _ in range(3))
        paper = tuple(rng.randint(190, 255) for _ in range(3))
    scale = size / IMAGE_SIZE
    image = Image.new("RGB", (size, size), paper)
    draw = ImageDraw.Draw(image)
    centre = (size / 2 + shift[0] * scale, size / 2 + shift[1] * scale)
    draw.text(centre, word, fill=ink, font=_font(font, round(pixels * scale)), anchor="mm")
    return image
