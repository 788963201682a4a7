"""spatial_pipelines: diffusers-style pipelines that make autoregressive image models fast with (spatial)
speculative decoding.

The public decoders, families and draft heads are read off the subpackages (every ``decoding_*.py``,
``pipeline_*.py`` and ``heads_*.py`` is imported there): a new one is its file. ``spatial_pipelines.<Name>`` also
resolves a decoder, pipeline, heads class or acceptance rule defined outside the package once it is defined
(`_registration.find_registered`): diffusers loads a saved folder's components by that name."""

# diffusers looks these names up on the library a component is recorded under: bind them here.
from diffusers import DiffusionPipeline, ModelMixin, SchedulerMixin

from . import decoders as _decoders
from . import heads as _heads
from . import pipelines as _pipelines
from ._registration import find_registered, register_with_diffusers
from .core import ImageTokenLayout, SamplingConfig
from .decoders import DECODERS, SpatialDecoderMixin, decoder_classes
from .heads import DraftHeadsMixin
from .models import ChameleonVQModel, LlamaGenTransformer, LlamaGenVQModel, PatchVQModel
from .pipelines import DecodingStats, GenerationLoop, SpatialARPipeline, SpatialBackbone, SpatialPipelineOutput, family_pipelines

register_with_diffusers()

__version__ = "0.1.0"


def _own(classes) -> list:
    """The names of the classes the package itself defines, bound here."""
    own = [cls for cls in classes if cls.__module__.startswith(__name__ + ".")]
    globals().update({cls.__name__: cls for cls in own})
    return [cls.__name__ for cls in own]


__all__ = [
    "DECODERS",
    "DecodingStats",
    "DiffusionPipeline",
    "DraftHeadsMixin",
    "GenerationLoop",
    "ImageTokenLayout",
    "ChameleonVQModel",
    "LlamaGenTransformer",
    "LlamaGenVQModel",
    "ModelMixin",
    "PatchVQModel",
    "SamplingConfig",
    "SchedulerMixin",
    "SpatialARPipeline",
    "SpatialBackbone",
    "SpatialDecoderMixin",
    "SpatialPipelineOutput",
    *_own(decoder_classes().values()),
    *_own(family_pipelines().values()),
    *_own(getattr(_heads, name) for name in _heads.__all__ if isinstance(getattr(_heads, name), type)
          and issubclass(getattr(_heads, name), DraftHeadsMixin) and getattr(_heads, name) is not DraftHeadsMixin),
]


def __getattr__(name: str):
    """A decoder, pipeline, heads class or acceptance rule defined outside the package (a user's file, a test module),
    by its class name: diffusers resolves a saved folder's ``["spatial_pipelines", "<Name>"]`` this way."""
    found = find_registered(name) if not name.startswith("_") else None
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found
