"""Data sets used to train and evaluate the embedded models (optional dependencies, read offline)."""

from .canonical import canonical_background_codes
from .twemoji import TwemojiDataset, caption_from_name, split_of, twemoji_items

__all__ = ["TwemojiDataset", "canonical_background_codes", "caption_from_name", "split_of", "twemoji_items"]
