"""Trainable draft heads (diffusers `ModelMixin` + `ConfigMixin`), loaded and pushed beside the frozen backbone.

Every ``heads_*.py`` module here is imported with the package and exports the names in its ``__all__`` (where it has
none: its heads classes, those that declare their own ``kind``, by which `heads_class_for` finds them)."""

from ..utils import import_modules
from .heads_utils import BACKBONE_FACTS, DraftHeadsMixin, check_backbone_facts, heads_class_for

__all__ = ["BACKBONE_FACTS", "DraftHeadsMixin", "check_backbone_facts", "heads_class_for",
           *import_modules(globals(), "heads_", lambda c: issubclass(c, DraftHeadsMixin) and c.__dict__.get("kind") is not None)]
