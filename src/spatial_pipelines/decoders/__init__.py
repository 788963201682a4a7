"""Decoders: one algorithm per file (``decoding_<name>.py``), weight-free, swappable with
``Decoder.from_config(pipe.decoder.config)``.

Every ``decoding_*.py`` module here is imported with the package and exports the names in its ``__all__`` (where it
has none: its decoder classes, those that set their own ``short_name``). A new decoder is its file."""

from ..utils import DerivedMapping, import_modules
from .decoding_tree import TreeDecoderMixin
from .decoding_utils import SpatialDecoderMixin, decoder_classes

#: ``{short name: decoder class}`` (the CLI's ``--decoder``, benchmark specs): every loaded decoder class that sets
#: its own ``short_name``, read off the classes at each access (`decoder_classes`), so a decoder defined in a user's
#: file or a test module is in it once defined.
DECODERS = DerivedMapping(decoder_classes)

__all__ = ["DECODERS", "SpatialDecoderMixin", "TreeDecoderMixin",
           *import_modules(globals(), "decoding_", lambda c: issubclass(c, SpatialDecoderMixin) and "short_name" in c.__dict__)]
