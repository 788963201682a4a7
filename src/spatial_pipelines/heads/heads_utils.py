"""The base of trainable draft heads: a diffusers model saved and shared beside a frozen backbone.

A heads folder is diffusers' format (``config.json`` + ``diffusion_pytorch_model.safetensors``). Its config
records the backbone it was trained for (``base_model_name_or_path``, ``base_model_revision``) and the backbone
facts that must match (hidden size, number of image codes, grid); loading against another backbone raises.
"""

import os
import re
from typing import Any, Dict, Optional, Sequence

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.utils import _add_variant, logging  # _add_variant: diffusers' variant file names
from huggingface_hub import ModelCard, constants
from torch import nn

from ..core.contracts import HEADS_KINDS, HeadsProvide, as_offsets
from ..hub import EMBEDDED_PREFIX, heads_card, hub_model_id, push_with_card, save_with_card
from ..utils import (PICKLE_SUFFIXES, available_memory, check_path_or_repo_id, check_safe_serialization,
                     check_choice, check_number, find_subclass, read_json_file, safetensors_header, subclasses)

logger = logging.get_logger(__name__)

#: The weights file of a heads folder (diffusers' name; safetensors only).
SAFETENSORS_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


#: Backbone facts a heads config records; each must equal the backbone's.
BACKBONE_FACTS = ("hidden_size", "num_image_codes", "grid_height", "grid_width")
#: Facts compared only when the heads record them (heads saved before they did load as before).
RECORDED_FACTS = ("family",)


def check_backbone_facts(heads_config: Dict[str, Any], backbone_facts: Dict[str, Any], what: str = "draft heads",
                         base_model: Optional[str] = None) -> None:
    """Raise `ValueError` naming every fact where ``heads_config`` and ``backbone_facts`` disagree: the family (when
    the heads record one), hidden size, code count and grid; and the heads' ``base_model_name_or_path`` against
    ``base_model`` (where the backbone came from), when `compare_base_models` tells they differ. When it cannot
    tell, a warning says so, once per pair of names."""
    compared = [k for k in RECORDED_FACTS if heads_config.get(k) is not None and backbone_facts.get(k) is not None]
    compared += [k for k in BACKBONE_FACTS if k in backbone_facts]
    wrong = [f"{k}: heads {heads_config.get(k)!r} != backbone {backbone_facts[k]!r}"
             for k in compared if heads_config.get(k) != backbone_facts[k]]
    base = heads_config.get("base_model_name_or_path")
    same, heads_side, backbone_side = compare_base_models(base, base_model)
    if same is False:
        wrong.insert(0, f"base_model_name_or_path: heads {heads_side} != backbone {backbone_side}")
    if wrong:
        raise ValueError(
            f"`draft_heads`: these {what} were made for another backbone ({base!r}); mismatched facts: "
            + "; ".join(wrong)
            + ". Load heads trained for this backbone, or train new ones."
        )
    if same is None and (str(base), str(base_model)) not in _UNTOLD:
        _UNTOLD.add((str(base), str(base_model)))
        logger.warning(
            f"Cannot tell whether these {what} were made for this backbone: they record the base model {heads_side}, "
            f"and the pipeline was loaded from {backbone_side}. A local folder is compared by its resolved path and by "
            "the Hub or embedded model its model_index.json says it was saved from, and neither settles it here. Their "
            "other facts match; heads made for another model draft poorly, and decoding gains little from them.")


#: (heads base, backbone source) pairs already warned about as impossible to compare (`check_backbone_facts`).
_UNTOLD = set()


def _local_folder(name_or_path) -> Optional[str]:
    """The resolved path of ``name_or_path`` when it names a folder on this machine, else ``None``."""
    if not name_or_path:
        return None
    path = os.fspath(name_or_path)
    return os.path.realpath(path) if os.path.isdir(path) else None


def saved_from(folder: Optional[str]) -> Optional[str]:
    """The name a pipeline folder records as the one it was saved from: its ``model_index.json``'s ``_name_or_path``
    (``None`` when it records none)."""
    path = os.path.join(folder, "model_index.json") if folder is not None else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        index = read_json_file(path, "model_index.json")
    except (OSError, ValueError):
        return None
    name = index.get("_name_or_path") if isinstance(index, dict) else None
    return name if isinstance(name, str) and name else None


def _known_identity(name: Optional[str]) -> Optional[str]:
    """`model_identity` of a name a folder records, when it surely names that model: an embedded model, or a Hub id
    this machine's Hub cache holds (a relative path ``dir/name`` reads like a Hub id, so an id alone is not enough)."""
    identity = model_identity(name)
    if identity is None or identity.startswith("embedded:"):
        return identity
    owner, repo = identity.split("/")
    return identity if os.path.isdir(os.path.join(constants.HF_HUB_CACHE, f"models--{owner}--{repo}")) else None


def compare_base_models(heads_base, backbone_source):
    """Whether heads recording ``heads_base`` (their ``base_model_name_or_path``) were made for a backbone loaded from
    ``backbone_source``: ``(same, heads side, backbone side)``, the sides described for messages.

    ``same`` is ``True`` when either is unset, or both name the same folder here (resolved paths) or the same Hub or
    embedded model (`model_identity`; for a pipeline folder also the known model it was saved from, `saved_from`: a
    pipeline loaded from ``org/name`` and saved keeps serving heads made for ``org/name``); ``False`` when both name
    Hub or embedded models and they differ; ``None`` when it cannot be told (a local folder not here, moved, or
    saved from no model known here)."""
    if not heads_base or not backbone_source:
        return True, repr(heads_base), repr(backbone_source)
    sides = []
    for name in (heads_base, backbone_source):
        folder = _local_folder(name)
        direct, recorded = model_identity(name), saved_from(folder)
        origin = _known_identity(recorded)
        text = repr(str(name))
        if recorded is not None and recorded != str(name):
            text += f" (saved from {recorded!r})"
        elif folder is None and direct is None:
            text += " (not a folder on this machine)"
        sides.append((folder, {i for i in (direct, origin) if i is not None}, text))
    (heads_folder, heads_ids, heads_text), (folder, ids, text) = sides
    if heads_folder is not None and heads_folder == folder:
        return True, heads_text, text
    if heads_ids and ids:
        return bool(heads_ids & ids), heads_text, text
    return None, heads_text, text


def model_identity(name_or_path) -> Optional[str]:
    """What a model name or path identifies, comparable across machines: ``"embedded:<name>"`` for the models shipped
    in this package (by package path or installed folder), ``"org/name"`` for a Hub id or a Hub cache snapshot
    folder; ``None`` when it cannot be told (unset, or another local folder: a pipeline saved from a Hub model keeps
    serving heads made for that model)."""
    if not name_or_path:
        return None
    name = os.fspath(name_or_path).replace("\\", "/").rstrip("/")
    at = name.find(EMBEDDED_PREFIX)
    if at == 0 or (at > 0 and name[at - 1] == "/"):
        return "embedded:" + name[at + len(EMBEDDED_PREFIX):].split("/")[0]
    snapshot = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", name + "/")
    if snapshot:
        return f"{snapshot.group(1)}/{snapshot.group(2)}"
    return hub_model_id(name)


def check_offsets(horizontal_offsets, vertical_offsets) -> None:
    """Raise `ValueError` unless each offset list is a list of distinct ints >= 1."""
    as_offsets("horizontal_offsets", horizontal_offsets)
    as_offsets("vertical_offsets", vertical_offsets)


def check_heads_args(base_model_name_or_path=None, base_model_revision=None, ints=(), optional_ints=(), positives=(),
                     family=None) -> None:
    """The argument checks every heads constructor shares: the base model id, revision and family are ``None`` or strings,
    ``ints`` are ints >= 1, ``optional_ints`` ``None`` or ints >= 1, ``positives`` finite numbers > 0 (each a
    ``(name, value)`` pair). Raises `ValueError` naming the argument."""
    for name, value in (("base_model_name_or_path", base_model_name_or_path), ("base_model_revision", base_model_revision),
                        ("family", family)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"`{name}` must be None or a string, got {value!r}.")
    for name, value in ints:
        check_number(name, value, 1, integer=True)
    for name, value in optional_ints:
        check_number(name, value, 1, integer=True, optional=True)
    for name, value in positives:
        check_number(name, value, 0, low_open=True)


#: The most values (parameters and buffers) a heads object may hold: past it (17 GB in fp32) no backbone served here
#: needs them, and building them would end in the allocator rather than in a message.
MAX_HEADS_VALUES = 2**32


def check_heads_size(class_name: str, values: int, sizes) -> None:
    """Raise `ValueError` naming the size arguments ``sizes`` (``(name, value)`` pairs) when heads of ``values``
    parameters and buffers exceed `MAX_HEADS_VALUES` or the free host memory, before anything is allocated."""
    named = ", ".join(f"`{n}={v}`" for n, v in sizes)
    if values > MAX_HEADS_VALUES:
        raise ValueError(f"{named}: these {class_name} would hold {values:.3g} values ({values * 4 / 2**30:.3g} GiB in "
                         f"fp32); at most {MAX_HEADS_VALUES:.3g} are built (no backbone served here needs more): check the "
                         "sizes against the backbone's config.")
    free = available_memory(torch.device("cpu"))
    if free is not None and values * 4 > 0.9 * free:
        raise ValueError(f"{named}: these {class_name} need {values * 4 / 2**30:.3g} GiB in fp32 and the host has "
                         f"{free / 2**30:.3g} GiB free.")


def heads_class_for(kind: str) -> type:
    """The heads class that provides ``kind`` (one of `HEADS_KINDS`): the loaded `DraftHeadsMixin` subclass that
    declares it in its own ``kind`` attribute, the classes of spatial_pipelines first.

    Args:
        kind (`str`): ``"offset_logits"``, ``"latent"`` or ``"drafter"``.
    """
    check_choice("kind", kind, HEADS_KINDS)
    declared = [c for c in subclasses(DraftHeadsMixin) if c.__dict__.get("kind") == kind]
    declared.sort(key=lambda c: not c.__module__.startswith(__package__.rsplit(".", 1)[0] + "."))
    if not declared:
        raise ValueError(f"`kind` {kind!r}: no loaded heads class declares it.")
    return declared[0]


class DraftHeadsMixin(ModelMixin, ConfigMixin):
    """Base of `SpatialDraftHeads`, `LatentDraftHeads` and `EagleDraftHead`.

    Subclasses register (with ``@register_to_config``) at least ``base_model_name_or_path``,
    ``base_model_revision`` and the `BACKBONE_FACTS`, declare their ``kind`` (one of `HEADS_KINDS`) and implement
    `provides`, what decoders check them against (`spatial_pipelines.core.contracts.check_heads`).
    """

    kind: Optional[str] = None  # the kind of heads a class provides (`HEADS_KINDS`); `heads_class_for` finds it

    @property
    def provides(self) -> HeadsProvide:
        """What these heads give a decoder (`HeadsProvide`): the class's ``kind`` and the offsets in its config (none
        for a drafter). A subclass that declares no ``kind`` raises `NotImplementedError`."""
        if self.kind is None:
            raise NotImplementedError(f"{type(self).__name__} does not say what it provides: a DraftHeadsMixin subclass "
                                      f"declares its `kind` (one of {HEADS_KINDS}) before a decoder can use it.")
        config = self.config
        return HeadsProvide(self.kind, tuple(config.get("horizontal_offsets", ())), tuple(config.get("vertical_offsets", ())))

    @classmethod
    def for_backbone(cls, backbone, decoder, random_init: bool = True, **kwargs) -> "DraftHeadsMixin":
        """Heads sized for ``backbone`` with the horizontal and vertical offsets ``decoder`` needs
        (``decoder.heads_needed()``); ``random_init`` redraws every projection (tests: drafts that differ from the
        backbone's own prediction)."""
        need = decoder.heads_needed()
        heads = cls(base_model_name_or_path=kwargs.pop("base_model_name_or_path", None),
                    horizontal_offsets=list(need.horizontal_offsets) if need is not None else [],
                    vertical_offsets=list(need.vertical_offsets) if need is not None else [],
                    **{**backbone.facts(), **kwargs})
        return heads._redrawn() if random_init else heads

    def _redrawn(self) -> "DraftHeadsMixin":
        """These heads, every linear layer's weight redrawn at ``1 / sqrt(fan_in)`` (`for_backbone`'s ``random_init``)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=1.0 / module.in_features**0.5)
        return self

    def frozen(self, horizontal: Sequence[int], vertical: Sequence[int]):
        """The heads ``horizontal`` and ``vertical`` (indices) as a function of post-norm hidden states ``(B, D)``:
        what a round compiled whole calls (`MedusaDrafter`, `HawkDrafter`). Token-logit heads are called as
        ``heads(hidden_states, horizontal, vertical)``, so this serves any of them; a class may return a faster function
        (`SpatialDraftHeads.frozen` stacks its weights once)."""
        horizontal, vertical = list(horizontal), list(vertical)
        return lambda hidden_states: self(hidden_states, horizontal, vertical)

    def check_modules(self) -> None:
        """Raise `ValueError` if the heads' modules no longer match their config (a head list emptied or resized
        after the heads were attached to a pipeline), or hold no values (``meta`` weights). A pipeline call checks
        its heads with this before any work."""
        for direction in ("horizontal", "vertical"):
            modules, offsets = getattr(self, direction, None), self.config.get(f"{direction}_offsets")
            if isinstance(modules, nn.ModuleList) and offsets is not None and len(modules) != len(offsets):
                raise ValueError(f"{type(self).__name__} has {len(modules)} {direction} heads but its config lists "
                                 f"{len(offsets)} `{direction}_offsets` {list(offsets)}: the heads were changed after they "
                                 "were built; load them again or attach heads that match their config.")
        if any(p.is_meta for p in self.parameters()):
            raise ValueError(f"{type(self).__name__} has weights on the meta device (no values): load them before use.")

    def check_backbone(self, backbone_facts: Dict[str, Any], base_model: Optional[str] = None) -> None:
        """Raise `ValueError` if these heads do not fit a backbone with ``backbone_facts`` loaded from ``base_model``
        (`check_backbone_facts`)."""
        check_backbone_facts(dict(self.config), backbone_facts, base_model=base_model)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, backbone_facts: Optional[Dict[str, Any]] = None,
                        base_model: Optional[str] = None, **kwargs):
        """Load heads (a folder or a Hub repo id); with ``backbone_facts`` the config is checked before any weight is
        read. Called on `DraftHeadsMixin` itself, loads the heads class the config names. Every failure is a
        `ValueError` naming the file: no config, a config of another class, no safetensors weights (pickles are never
        read), a corrupt weights file, weights that do not fit the config (never random weights with a warning)."""
        path = pretrained_model_name_or_path
        check_path_or_repo_id(path, "pretrained_model_name_or_path")
        hub_kwargs = {k: v for k, v in kwargs.items() if k in ("subfolder", "revision", "cache_dir", "local_files_only", "token")}
        local_config = os.path.join(os.fspath(path), kwargs.get("subfolder") or "", "config.json")
        if os.path.isfile(local_config):
            read_json_file(local_config, "draft-heads config")  # nesting and encoding, before diffusers parses it
        try:
            config = cls.load_config(path, **hub_kwargs)
        except (OSError, ValueError) as err:
            raise ValueError(f"`pretrained_model_name_or_path` {str(path)!r} holds no draft-heads config (config.json): {err}") from err
        name = config.get("_class_name")
        target = find_subclass(DraftHeadsMixin, name)
        if target is None or not issubclass(target, cls):
            raise ValueError(
                f"The config.json at {str(path)!r} is of class {name!r}, not a {cls.__name__} of spatial_pipelines "
                f"({', '.join(sorted(c.__name__ for c in [cls, *subclasses(cls)]))})."
            )
        if target is not cls:
            return target.from_pretrained(path, backbone_facts=backbone_facts, base_model=base_model, **kwargs)
        if backbone_facts is not None:
            check_backbone_facts(config, backbone_facts, base_model=base_model)
        folder = os.path.join(str(path), kwargs.get("subfolder") or "")
        if os.path.isdir(folder):  # local: say what is wrong with the weights file before diffusers tries it
            variant = kwargs.get("variant")
            name = _add_variant(SAFETENSORS_WEIGHTS_NAME, variant)  # diffusion_pytorch_model[.fp16].safetensors
            weights = os.path.join(folder, name)
            if not os.path.isfile(weights):
                found = sorted(f for f in os.listdir(folder) if f != "config.json")
                what = f" of variant {variant!r}" if variant else ""
                pickles = " (pickles are refused here: loading one can run any code)" if any(
                    f.endswith(PICKLE_SUFFIXES) for f in found) else ""
                raise ValueError(f"The draft-heads folder {folder!r} has no weights file{what} {name!r} "
                                 f"(found: {found or 'nothing else'}); spatial_pipelines reads safetensors only{pickles}.")
            safetensors_header(weights, "draft-heads weights")  # whole: not truncated, corrupt or a pickle
        kwargs.setdefault("low_cpu_mem_usage", False)
        kwargs["ignore_mismatched_sizes"] = False
        kwargs["use_safetensors"] = True  # never fall back to a pickled .bin
        try:
            model, info = super().from_pretrained(path, output_loading_info=True, **kwargs)
        except (OSError, RuntimeError, ValueError) as err:
            raise ValueError(f"`draft_heads` at {str(path)!r} could not be loaded: {err}") from err
        bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if bad:
            raise ValueError(f"`draft_heads` at {str(path)!r} do not fit their config: {bad}")
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save config + safetensors + the adapter card (``README.md``, `model_card`) all at once; a failed save
        leaves no partial folder. With ``push_to_hub=True`` the folder is then uploaded to ``repo_id`` (default: the
        folder's name; other arguments as in diffusers), the files `push_to_hub` sends; without it, ``repo_id`` only
        names the repo in the card's load snippet. ``benchmark`` and ``training_command`` go to `model_card`."""
        check_safe_serialization(kwargs.pop("safe_serialization", True))
        kwargs["safe_serialization"] = True
        card = {k: kwargs.pop(k) for k in ("benchmark", "training_command") if k in kwargs}
        return save_with_card(self, save_directory, kwargs, lambda tmp: super(DraftHeadsMixin, self).save_pretrained(tmp, *args, **kwargs),
                              lambda repo_id: self.model_card(repo_id=repo_id, **card))

    def push_to_hub(self, repo_id: str, commit_message: Optional[str] = None, private: Optional[bool] = None,
                    token: Optional[str] = None, create_pr: bool = False, safe_serialization: bool = True,
                    variant: Optional[str] = None, subfolder: Optional[str] = None, *, benchmark=None,
                    training_command: Optional[str] = None) -> str:
        """Upload these heads to the Hub repo ``repo_id``: weights (safetensors), config and the adapter card of
        `model_card`, the files ``save_pretrained(..., push_to_hub=True)`` sends. Arguments as diffusers'
        `PushToHubMixin.push_to_hub`; ``benchmark`` and ``training_command`` go to `model_card`."""
        return push_with_card(self, repo_id, dict(variant=variant, benchmark=benchmark, training_command=training_command),
                              private=private, token=token, commit_message=commit_message, create_pr=create_pr,
                              subfolder=subfolder, safe_serialization=safe_serialization)

    def model_card(self, repo_id: Optional[str] = None, benchmark=None, training_command: Optional[str] = None, **fields) -> ModelCard:
        """The Hub card declaring these heads an adapter of their base model (`spatial_pipelines.hub.heads_card`,
        rendered from the template of their kind).

        Args:
            repo_id (`str`, *optional*): the heads' repo id (or folder), for the load snippet.
            benchmark (`str`, `os.PathLike` or `dict`, *optional*): a ``scripts/benchmark.py`` report
                (``benchmark.json``); its rows of the decoders that use these heads fill the speed table.
            training_command (`str`, *optional*): how they were trained (default: the config's
                ``training_command``, else the ``scripts/train_heads.py`` command of their kind and config).
            fields: further card fields (``base_model``, ``benchmark_source``, ``notes``, ...; see `heads_card`).
        """
        return heads_card([c.__name__ for c in type(self).__mro__], dict(self.config), repo_id=repo_id,
                          benchmark=benchmark, training_command=training_command, **fields)
