"""The Lumina-mGPT family: Chameleon-architecture checkpoints (``Alpha-VLLM/Lumina-mGPT-7B-512/-768/-1024``, HF format,
model_type ``chameleon``) with resolution tokens and end-of-row tokens; the Chameleon adapter with Lumina's layout.

Lumina-mGPT facts (its ``inference_solver.py`` / ``item_processor.py``, checked against the public code):

* prompt: ``BOS "Generate an image of {w}x{h} according to the following prompt:\\n{prompt}" <reserved08706>`` (a
  human turn of its conversation template, ``{w}x{h}`` in pixels), then the image;
* image: ``<racm3:break>``, two resolution tokens ``<reserved{8800 + h/32:05d}>`` ``<reserved{8800 + w/32:05d}>``
  (``h, w`` in pixels: one step per 32-pixel patch, i.e. per 2 codes of the 16-pixel VQGAN), then ``H`` rows of ``W``
  codes each followed by the end-of-row token ``<reserved08799>`` (the last row included), then ``<eoss>``. The
  structural tokens are forced, never sampled: the resolution tokens are part of the prefix, the EOLs are fed by the
  loop (`ImageTokenLayout` with ``eol_token_id``);
* CFG on raw logits (``LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor``; scale 3.0 in
  ``create_logits_processor``), the unconditional context being the sequence from ``<racm3:break>`` on -- no BOS, no
  text: ``<racm3:break> res_h res_w codes...``; image top-k 2000 after restricting to the image tokens;
* 768 px -> 48x48 codes (+48 EOLs).
"""

import os
import re
from typing import Any, Dict, List, Optional, Tuple, Union

from ..core.layout import ImageTokenLayout
from ..utils import check_number
from .pipeline_chameleon import ChameleonARPipeline, ChameleonBackbone, ChameleonVQModel, dummy_chameleon_components
from .transformers_utils import configure_generation

#: Lumina-mGPT's text-to-image prompt (``demos/demo_image_generation.py``), sizes in pixels.
LUMINA_PROMPT_TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"
LUMINA_EOL_TOKEN = "<reserved08799>"
#: resolution tokens count ``patch``-pixel steps: ``<reserved{8800 + pixels // patch:05d}>``
LUMINA_RESOLUTION_BASE = 8800
LUMINA_RESOLUTION_PATCH = 32
LUMINA_GUIDANCE_SCALE = 3.0
LUMINA_TOP_K = 2000
LUMINA_IMAGE_SIZE = 768
#: generation-config key of the resolution patch size (pixels per resolution-token step)
RESOLUTION_PATCH_KEY = "resolution_patch_size"


class LuminaMGPTBackbone(ChameleonBackbone):
    """Lumina-mGPT: the Chameleon adapter with resolution tokens after ``<racm3:break>``, an end-of-row token after every
    row, its prompt template and an unconditional row without BOS or text."""

    family = "lumina_mgpt"

    default_image_grid = (LUMINA_IMAGE_SIZE // 16, LUMINA_IMAGE_SIZE // 16)
    row_end_positions = 1  # the end-of-row token after every row
    family_guidance_scale = LUMINA_GUIDANCE_SCALE
    family_top_k = LUMINA_TOP_K
    unconditional_has_bos = False
    family_name = "Lumina-mGPT"

    @property
    def layout(self) -> ImageTokenLayout:
        h, w = self.image_grid
        return ImageTokenLayout(h, w, eol_token_id=self.token_id(LUMINA_EOL_TOKEN))

    @property
    def eol_embedding(self):
        self._onload()
        return self.text_model.embed_tokens.weight[self.token_id(LUMINA_EOL_TOKEN)]

    @property
    def resolution_patch_size(self) -> int:
        return int(getattr(self.generation_config, RESOLUTION_PATCH_KEY, None) or LUMINA_RESOLUTION_PATCH)

    @property
    def image_size(self) -> Tuple[int, int]:
        """(height, width) in pixels."""
        h, w = self.image_grid
        f = self.vae_scale_factor
        return h * f, w * f

    def resolution_token(self, pixels: int, name: str) -> str:
        patch = self.resolution_patch_size
        if pixels % patch:
            raise ValueError(f"Lumina-mGPT image {name} {pixels} px (`image_grid` x {self.vae_scale_factor} px per code) is "
                             f"not a multiple of its {patch}-pixel resolution step: choose an `image_grid` of multiples of "
                             f"{max(1, patch // self.vae_scale_factor)} codes.")
        return f"<reserved{LUMINA_RESOLUTION_BASE + pixels // patch:05d}>"

    def image_start_ids(self) -> List[int]:
        height, width = self.image_size
        return [self.token_id("<racm3:break>"), self.token_id(self.resolution_token(height, "height")),
                self.token_id(self.resolution_token(width, "width"))]

    def prompt_text(self, text: str) -> str:
        height, width = self.image_size
        return LUMINA_PROMPT_TEMPLATE.format(width=width, height=height, prompt=text)


class LuminaMGPTPipeline(ChameleonARPipeline):
    r"""Lumina-mGPT text-to-image generation with a swappable speculative decoder.

    Components as `ChameleonARPipeline` (``processor``: the checkpoint's tokenizer or a `ChameleonProcessor`). Defaults:
    48x48 codes (768 px; ``image_grid`` in the generation config), CFG 3.0 against ``<racm3:break> res_h res_w``,
    image top-k 2000; an end-of-row token after every row. Load ``Alpha-VLLM/Lumina-mGPT-7B-768`` with `from_backbone`.
    """

    backbone_class = LuminaMGPTBackbone

    @classmethod
    def dummy_components(cls, grid=(4, 4), num_codes: int = 16) -> Dict[str, Any]:
        """Tiny random components of this family, for tests (`spatial_pipelines.testing.dummy_pipeline`; call under a
        fixed seed): ``{name: component}`` for the pipeline's ``__init__``, less the decoder and draft heads."""
        return dummy_chameleon_components(grid, num_codes, lumina=True)

    @classmethod
    def default_image_grid_for(cls, repo_or_path, vae_scale_factor: int) -> Tuple[int, int]:
        """The checkpoint's training size when its name ends in it (``Lumina-mGPT-7B-512/-768/-1024``), else 768 px."""
        match = re.search(r"-(512|768|1024)$", os.path.basename(os.fspath(repo_or_path).rstrip("/")))
        size = int(match.group(1)) if match else LUMINA_IMAGE_SIZE
        return size // vae_scale_factor, size // vae_scale_factor

    @classmethod
    def load_backbone_components(cls, repo_or_path: Union[str, os.PathLike],
                                 vq: Union[None, str, os.PathLike, ChameleonVQModel] = None,
                                 image_grid: Optional[Tuple[int, int]] = None, resolution_patch_size: Optional[int] = None,
                                 **kwargs: Any) -> Dict[str, Any]:
        """`ChameleonARPipeline.load_backbone_components` for a Lumina-mGPT repo (tokenizer files, no processor).

        Args:
            image_grid (`tuple[int, int]`, *optional*): codes per column and row; default: the size in the repo name
                (``-512``, ``-768``, ``-1024``) over 16 px per code, else 48x48 (768 px). Sizes must be multiples of
                32 px (the resolution tokens' step).
            resolution_patch_size (`int`, *optional*): pixels per resolution-token step (32).
            kwargs: as `ChameleonARPipeline.load_backbone_components` (``vq``, ``processor``, defaults, dtype, hub).
        """
        components = super().load_backbone_components(repo_or_path, vq=vq, image_grid=image_grid, **kwargs)
        if resolution_patch_size is not None:
            check_number("resolution_patch_size", resolution_patch_size, 1, integer=True)
            configure_generation(components["transformer"], **{RESOLUTION_PATCH_KEY: int(resolution_patch_size)})
        return components
