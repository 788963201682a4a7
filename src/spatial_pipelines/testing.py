"""Tiny random pipelines for tests (ours and users'): CPU, built in well under a second, no downloads. Each family
builds its own tiny components beside its pipeline class (``dummy_components`` in ``pipelines/pipeline_<family>.py``);
their builders are importable from here too."""

import inspect
from typing import Tuple, Union

import torch

from .decoders import DECODERS, AutoregressiveDecoder, SpatialDecoderMixin
from .heads import DraftHeadsMixin, heads_class_for
from .pipelines import SpatialARPipeline, family_pipelines
from .pipelines.pipeline_chameleon import chameleon_image_token, dummy_chameleon_components, tiny_chameleon_tokenizer
from .pipelines.pipeline_emu3 import dummy_emu3_components, tiny_emu3_processor
from .pipelines.pipeline_janus import dummy_janus_components, tiny_janus_processor
from .pipelines.pipeline_llamagen import dummy_llamagen_components, tiny_tokenizer
from .utils import DerivedMapping

__all__ = ["FAMILIES", "chameleon_image_token", "dummy_chameleon_components", "dummy_emu3_components", "dummy_janus_components",
           "dummy_llamagen_components", "dummy_pipeline", "random_draft_heads", "tiny_chameleon_tokenizer", "tiny_emu3_processor",
           "tiny_janus_processor", "tiny_tokenizer"]

#: ``{family: pipeline class}`` of every loaded family (`family_pipelines`: a pipeline class with its own
#: ``dummy_components``), read off the classes at each access: a family defined in a test module is in it.
FAMILIES = DerivedMapping(family_pipelines)


def dummy_pipeline(family: str, decoder: Union[None, str, SpatialDecoderMixin] = None,
                   draft_heads: Union[None, str, DraftHeadsMixin] = None, *, grid: Tuple[int, int] = (4, 4),
                   num_codes: int = 16, seed: int = 0, condition_type: str = "text",
                   end_of_row: bool = False) -> SpatialARPipeline:
    """A tiny random pipeline of ``family`` on CPU.

    Args:
        family (`str`): a key of `FAMILIES` (``"llamagen"``, ``"janus"``, ``"emu3"``, ...: its pipeline class's
            ``dummy_components`` builds the components).
        decoder: a decoder, a short name from ``DECODERS`` (``"ar"`` ...), or ``None`` for `AutoregressiveDecoder`.
        draft_heads: heads, ``"random"`` for randomly initialised heads of the kind the decoder needs, or ``None``.
        grid (`tuple[int, int]`): the code grid (height, width).
        num_codes (`int`): codebook size.
        seed (`int`): weights are a function of the seed alone (the global RNG is left untouched).
        condition_type (`str`): LlamaGen only: ``"text"`` (a tiny T5 encoder) or ``"class"``.
        end_of_row (`bool`): LlamaGen only: give the transformer an end-of-row token fed after every row (the
            layout Emu3 and Lumina-mGPT use), to exercise EOL handling on a small model.
    """
    pipeline_class = FAMILIES.get(family)
    if pipeline_class is None:
        raise ValueError(f"`family` must be one of {tuple(FAMILIES)}, got {family!r}.")
    options = {**({"condition_type": condition_type} if condition_type != "text" else {}),
               **({"end_of_row": end_of_row} if end_of_row else {})}  # LlamaGen's, passed only when set
    accepted = inspect.signature(pipeline_class.dummy_components).parameters
    if any(k not in accepted for k in options):
        raise ValueError("`condition_type` and `end_of_row` are LlamaGen options (a family's own layout is fixed).")
    if isinstance(decoder, str):
        if decoder not in DECODERS:
            raise ValueError(f"`decoder` must be one of {sorted(DECODERS)} or a decoder object, got {decoder!r}.")
        decoder = DECODERS[decoder]()
    decoder = decoder if decoder is not None else AutoregressiveDecoder()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = pipeline_class(**pipeline_class.dummy_components(grid, num_codes, **options), decoder=decoder)
        if isinstance(draft_heads, str):
            if draft_heads != "random":
                raise ValueError(f"`draft_heads` must be heads, 'random' or None, got {draft_heads!r}.")
            draft_heads = random_draft_heads(pipe, decoder)
        if draft_heads is not None:
            pipe.set_draft_heads(draft_heads)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def random_draft_heads(pipe: SpatialARPipeline, decoder: SpatialDecoderMixin) -> DraftHeadsMixin:
    """Randomly initialised heads of the kind ``decoder`` needs (the first of its ``heads_needed().kinds``), sized for
    ``pipe``'s backbone."""
    need = decoder.heads_needed()
    if need is None:
        raise ValueError(f"`draft_heads='random'`: {type(decoder).__name__} uses no draft heads.")
    return heads_class_for(need.kinds[0]).for_backbone(pipe.backbone, decoder)
