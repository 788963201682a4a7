"""Trainable draft heads (diffusers `ModelMixin` + `ConfigMixin`), loaded and pushed beside the frozen backbone."""

from .heads_eagle import EagleDraftHead
from .heads_latent import LatentDraftHeads
from .heads_medusa import SpatialDraftHeads
from .heads_utils import BACKBONE_FACTS, DraftHeadsMixin, check_backbone_facts, heads_class_for

__all__ = ["BACKBONE_FACTS", "DraftHeadsMixin", "EagleDraftHead", "LatentDraftHeads", "SpatialDraftHeads", "check_backbone_facts",
           "heads_class_for"]
