"""The base of trainable draft heads: a diffusers model saved and shared beside a frozen backbone.

A heads folder is diffusers' format (``config.json`` + ``diffusion_pytorch_model.safetensors``). Its config
records the backbone it was trained for (``base_model_name_or_path``, ``base_model_revision``) and the backbone
facts that must match (hidden size, number of image codes, grid); loading against another backbone raises.
"""

import os
from typing import Any, Dict, Optional

from diffusers import ConfigMixin, ModelMixin
from huggingface_hub import ModelCard, ModelCardData, create_repo
from torch import nn

from ..utils import atomic_directory

#: Backbone facts a heads config records; each must equal the backbone's.
BACKBONE_FACTS = ("hidden_size", "num_image_codes", "grid_height", "grid_width")


def check_backbone_facts(heads_config: Dict[str, Any], backbone_facts: Dict[str, Any], what: str = "draft heads") -> None:
    """Raise `ValueError` naming every fact where ``heads_config`` and ``backbone_facts`` disagree."""
    wrong = [
        f"{k}: heads {heads_config.get(k)!r} != backbone {backbone_facts[k]!r}"
        for k in BACKBONE_FACTS
        if k in backbone_facts and heads_config.get(k) != backbone_facts[k]
    ]
    if wrong:
        base = heads_config.get("base_model_name_or_path")
        raise ValueError(
            f"`draft_heads`: these {what} were made for another backbone ({base!r}); mismatched facts: "
            + "; ".join(wrong)
            + ". Load heads trained for this backbone, or train new ones."
        )


def check_offsets(horizontal_offsets, vertical_offsets) -> None:
    """Raise `ValueError` unless each offset list holds distinct offsets >= 1."""
    for name, offsets in (("horizontal_offsets", horizontal_offsets), ("vertical_offsets", vertical_offsets)):
        if any(int(o) < 1 for o in offsets) or len(set(offsets)) != len(offsets):
            raise ValueError(f"`{name}` must hold distinct offsets >= 1, got {list(offsets)}.")


class DraftHeadsMixin(ModelMixin, ConfigMixin):
    """Base of `SpatialDraftHeads`, `LatentDraftHeads` and `EagleDraftHead`.

    Subclasses register (with ``@register_to_config``) at least ``base_model_name_or_path``,
    ``base_model_revision`` and the `BACKBONE_FACTS`.
    """

    @classmethod
    def for_backbone(cls, backbone, decoder, random_init: bool = True, **kwargs) -> "DraftHeadsMixin":
        """Heads sized for ``backbone`` with the horizontal and vertical offsets ``decoder`` uses;
        ``random_init`` redraws every projection (tests: drafts that differ from the backbone's own prediction)."""
        heads = cls(
            base_model_name_or_path=kwargs.pop("base_model_name_or_path", None),
            horizontal_offsets=decoder.required_horizontal_offsets(),
            vertical_offsets=decoder.required_vertical_offsets(),
            **{**backbone.facts(), **kwargs},
        )
        if random_init:
            for module in heads.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=1.0 / module.in_features**0.5)
        return heads

    def check_backbone(self, backbone_facts: Dict[str, Any]) -> None:
        """Raise `ValueError` if these heads do not fit a backbone with ``backbone_facts``."""
        check_backbone_facts(dict(self.config), backbone_facts)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, backbone_facts: Optional[Dict[str, Any]] = None, **kwargs):
        """Load heads; with ``backbone_facts`` the config is checked before any weight is read.

        Weights whose names or shapes do not fit the config raise `ValueError` (never random weights with a
        warning).
        """
        config = cls.load_config(pretrained_model_name_or_path, **{k: v for k, v in kwargs.items() if k in ("subfolder", "revision", "cache_dir", "local_files_only", "token")})
        if backbone_facts is not None:
            check_backbone_facts(config, backbone_facts)
        kwargs.setdefault("low_cpu_mem_usage", False)
        kwargs["ignore_mismatched_sizes"] = False
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, output_loading_info=True, **kwargs)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"`draft_heads` at {pretrained_model_name_or_path!r} do not fit their config: {err}") from err
        bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if bad:
            raise ValueError(f"`draft_heads` at {pretrained_model_name_or_path!r} do not fit their config: {bad}")
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save config + safetensors (and a model card) all at once; a failed save leaves no partial folder."""
        kwargs["safe_serialization"] = True
        push = kwargs.pop("push_to_hub", False)
        hub = {k: kwargs.pop(k) for k in ("repo_id", "private", "token", "commit_message", "create_pr") if k in kwargs}
        with atomic_directory(save_directory) as tmp:
            super().save_pretrained(tmp, *args, **kwargs)
            self.model_card().save(os.path.join(tmp, "README.md"))
        if push:
            repo_name = hub.get("repo_id", os.path.basename(os.path.abspath(save_directory)))
            repo_id = create_repo(repo_name, exist_ok=True, private=hub.get("private"), token=hub.get("token")).repo_id
            self._upload_folder(
                save_directory, repo_id, token=hub.get("token"), commit_message=hub.get("commit_message"),
                create_pr=hub.get("create_pr", False),
            )

    def model_card(self) -> ModelCard:
        """A Hub model card declaring these heads an adapter of their base model."""
        base = self.config.get("base_model_name_or_path")
        data = ModelCardData(
            library_name="spatial_pipelines",
            base_model=base if base and not os.path.isdir(str(base)) else None,
            base_model_relation="adapter" if base else None,
            tags=["spatial_pipelines", "speculative-decoding", "draft-heads"],
        )
        facts = ", ".join(f"{k}={self.config.get(k)}" for k in BACKBONE_FACTS)
        text = (
            f"---\n{data.to_yaml()}\n---\n\n# {type(self).__name__}\n\n"
            f"Draft heads for speculative decoding of `{base}` with `spatial_pipelines` ({facts}).\n\n"
            "```python\nfrom spatial_pipelines import LlamaGenPipeline\n"
            "pipe = LlamaGenPipeline.from_pretrained(BASE)\npipe.load_draft_heads(THIS_REPO)\n```\n"
        )
        return ModelCard(text)
