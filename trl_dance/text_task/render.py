"""Words rendered as images with the TrueType fonts matplotlib ships (no download): the text task's training data
and its ground truth."""

from __future__ import annotations

import dataclasses
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
reads as "8": not used). The VAE learns every one of them."""


@dataclasses.dataclass(frozen=True)
class Style:
    """The range a render's style is drawn from: fonts, font size in pixels (inclusive), largest offset of the
    word's centre per axis in pixels, and the ranges of the ink's and the paper's RGB values."""

    fonts: tuple[str, ...] = FONTS
    pixels: tuple[int, int] = (19, 23)
    max_shift: int = 4
    ink: tuple[int, int] = (0, 90)
    paper: tuple[int, int] = (190, 255)


VAE_STYLE = Style()
"""What the VAE is trained to reconstruct: six fonts, 19-23 px (ink 14-17 px tall, several latent pixels per glyph
after a factor-2 VAE), offsets up to 4 px, dark ink on light paper of random hues."""
TEXT_STYLE = Style(fonts=("DejaVuSans-Bold.ttf", "DejaVuSerif-Bold.ttf"), pixels=(21, 23), max_shift=2, ink=(0, 60),
                   paper=(200, 255))  # fmt: skip
"""What the text model is trained to render: two bold fonts, two sizes, offsets up to 2 px, random hues. A wider
range (:data:`VAE_STYLE`) spent the transformer's first thousand steps on style: after 1,200 steps at batch 32 it drew
the same glyphs for every word."""

IMAGE_SIZE = 64


@functools.cache
def _font(name: str, pixels: int) -> ImageFont.FreeTypeFont:
    import matplotlib

    return ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", name), pixels)


def render_word(
    word: str, rng: random.Random | None = None, size: int = IMAGE_SIZE, style: Style = VAE_STYLE
) -> Image.Image:
    """``word`` on a plain background, ``size`` × ``size`` RGB. With ``rng``: font, size, offset and colours drawn
    from ``style``; without: DejaVu Sans Bold at 23 px, centred, black on white (the ground truth OCR engines are
    checked on)."""
    if rng is None:
        font, pixels, shift, ink, paper = FONTS[1], 23, (0, 0), (0, 0, 0), (255, 255, 255)
    else:
        font, pixels = rng.choice(style.fonts), rng.randint(*style.pixels)
        shift = (rng.randint(-style.max_shift, style.max_shift), rng.randint(-style.max_shift, style.max_shift))
        ink = tuple(rng.randint(*style.ink) for _ in range(3))
        paper = tuple(rng.randint(*style.paper) for _ in range(3))
    scale = size / IMAGE_SIZE
    image = Image.new("RGB", (size, size), paper)
    draw = ImageDraw.Draw(image)
    centre = (size / 2 + shift[0] * scale, size / 2 + shift[1] * scale)
    draw.text(centre, word, fill=ink, font=_font(font, round(pixels * scale)), anchor="mm")
    return image
