"""Model cards (``README.md``) for everything spatial_pipelines saves or pushes to the Hub.

Draft heads' card declares them an adapter of their backbone (``base_model`` when it is a Hub repo id,
``base_model_relation: adapter``, ``library_name: spatial_pipelines``) and says what they are, the backbone facts they
fit, the decoders that draft with them, how they were trained, how fast they ran (a ``scripts/benchmark.py`` report)
and how to load them. A pipeline's card says what it is (family, decoder, draft heads), the packages loading it needs
and how to load it. Cards are rendered from the Jinja templates in ``spatial_pipelines/hub_cards/templates/`` (one per
heads kind, `HEADS_TEMPLATES`, one for other heads, one for pipelines) by the heads' and pipelines' ``save_pretrained``
/ ``push_to_hub``; ``scripts/make_cards.py`` renders those of the embedded model and its heads.
"""

import json
import os
import tempfile
from typing import Any, Dict, Mapping, Optional, Sequence, Union

from huggingface_hub import ModelCard, ModelCardData, create_repo
from huggingface_hub.utils import HFValidationError, validate_repo_id

from .utils import atomic_directory

#: Folder of the card templates (package data).
TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hub_cards", "templates")
#: The template of each draft-heads kind; subclasses of a kind use their kind's template.
HEADS_TEMPLATES = {
    "SpatialDraftHeads": "spatial_draft_heads.md",
    "LatentDraftHeads": "latent_draft_heads.md",
    "EagleDraftHead": "eagle_draft_head.md",
}
#: The template of any other `DraftHeadsMixin` subclass.
GENERIC_HEADS_TEMPLATE = "draft_heads.md"
PIPELINE_TEMPLATE = "pipeline.md"

LIBRARY_NAME = "spatial_pipelines"
HEADS_TAGS = ["spatial_pipelines", "speculative-decoding", "draft-heads"]
#: the tags of the decoders that use each heads kind (spatial heads with vertical offsets add "hawk")
HEADS_KIND_TAGS = {"SpatialDraftHeads": ["medusa"], "LatentDraftHeads": ["ssd"], "EagleDraftHead": ["eagle"]}
#: Decoders (class names) that draft with each heads kind. `JacobiDecoder` (``init="heads"``) reads the vertical
#: offset 1 of either spatial kind, so it is shared.
HEADS_DECODERS = {
    "SpatialDraftHeads": ("MedusaDecoder", "HawkDecoder", "JacobiDecoder"),
    "LatentDraftHeads": ("SSDDecoder", "JacobiDecoder"),
    "EagleDraftHead": ("EagleDecoder", "ADTTreeDecoder"),
}
SHARED_DECODERS = ("JacobiDecoder",)
#: Keyword arguments of ``save_pretrained(..., push_to_hub=True)`` that belong to the upload.
HUB_KWARGS = ("repo_id", "private", "token", "commit_message", "create_pr")
EMBEDDED_PREFIX = "spatial_pipelines/embedded/"
#: The speed table's formatted columns: (card field, benchmark report field, format, suffix).
SPEED_COLUMNS = (("codes_per_pass", "mean_accepted_length", ".2f", ""),
                 ("target_passes", "target_forward_passes_per_image", ".1f", ""),
                 ("draft_passes", "draft_passes_per_image", ".0f", ""), ("seconds", "seconds_per_image", ".2f", ""),
                 ("speedup", "speedup_vs_ar", ".2f", "x"))

PathOrDict = Union[str, os.PathLike, Mapping[str, Any]]


# -- Hub plumbing ------------------------------------------------------------------------------------------
def hub_model_id(name_or_path: Optional[Union[str, os.PathLike]]) -> Optional[str]:
    """``name_or_path`` if it is a Hub model id (``org/name``, valid for the Hub, not an existing local path and not a
    ``spatial_pipelines/embedded/...`` package path), else ``None``."""
    if name_or_path is None:
        return None
    name = os.fspath(name_or_path)
    if not name or name.count("/") != 1 or name.replace("\\", "/").startswith(EMBEDDED_PREFIX) or os.path.exists(name):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def create_hub_repo(repo_id: str, private: Optional[bool] = None, token: Optional[str] = None) -> str:
    """Create (or find) the model repo ``repo_id``; returns its full id (``user/name`` for a bare ``name``)."""
    return create_repo(repo_id, exist_ok=True, private=private, token=token).repo_id


def upload_to_hub(obj, folder: Union[str, os.PathLike], repo_id: str, token: Optional[str] = None,
                  commit_message: Optional[str] = None, create_pr: bool = False, subfolder: Optional[str] = None):
    """Upload every file of ``folder`` to ``repo_id`` with ``obj``'s (diffusers `PushToHubMixin`) uploader."""
    return obj._upload_folder(os.fspath(folder), repo_id, token=token, commit_message=commit_message,
                              create_pr=create_pr, subfolder=subfolder)


def save_with_card(obj, save_directory: Union[str, os.PathLike], kwargs: Dict[str, Any], write, card=None):
    """What heads' and pipelines' ``save_pretrained`` share: ``write(folder)`` and the card into ``save_directory``
    all at once (a failed save leaves the folder as it was), then, with ``push_to_hub=True`` in ``kwargs``, upload it.

    Pops ``push_to_hub`` and the Hub arguments (`HUB_KWARGS`) from ``kwargs`` before ``write`` runs. ``card`` maps the
    repo id (created first when pushing: default the folder's name) to the `ModelCard` written as ``README.md``.
    """
    push = kwargs.pop("push_to_hub", False)
    hub = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
    repo_id = hub.get("repo_id")
    if push:
        repo_id = create_hub_repo(repo_id or os.path.basename(os.path.abspath(save_directory)),
                                  private=hub.get("private"), token=hub.get("token"))
    model_card = card(repo_id) if card is not None else None
    with atomic_directory(save_directory) as tmp:
        write(tmp)
        if model_card is not None:  # ours, never diffusers' generic card
            model_card.save(os.path.join(tmp, "README.md"))
    if push:
        return upload_to_hub(obj, save_directory, repo_id, token=hub.get("token"), commit_message=hub.get("commit_message"),
                             create_pr=hub.get("create_pr", False))
    return None


def push_with_card(obj, repo_id: str, save_kwargs: Dict[str, Any], private: Optional[bool] = None,
                   token: Optional[str] = None, commit_message: Optional[str] = None, create_pr: bool = False,
                   subfolder: Optional[str] = None, safe_serialization: bool = True) -> str:
    """What heads' and pipelines' ``push_to_hub`` share: create the repo, ``obj.save_pretrained`` (with ``save_kwargs``)
    into a temporary folder (our card included, so diffusers' generic card is never written), upload it."""
    if not safe_serialization:
        raise ValueError("`safe_serialization=False` is not supported: spatial_pipelines saves safetensors only.")
    repo_id = create_hub_repo(repo_id, private=private, token=token)
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "upload")
        obj.save_pretrained(folder, repo_id=repo_id, **save_kwargs)
        return upload_to_hub(obj, folder, repo_id, token=token, commit_message=commit_message, create_pr=create_pr,
                             subfolder=subfolder)


def _literal(value) -> str:
    """``value`` as Python source (strings in double quotes)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _render(template: str, card_data: ModelCardData, **fields) -> ModelCard:
    return ModelCard.from_template(card_data, template_path=os.path.join(TEMPLATES_DIR, template), **fields)


# -- benchmark reports ---------------------------------------------------------------------------------------
def load_benchmark(benchmark: Optional[PathOrDict]) -> Optional[Dict[str, Any]]:
    """A ``scripts/benchmark.py`` report (``benchmark.json``) from a path, or the dict itself."""
    if benchmark is None:
        return None
    if isinstance(benchmark, Mapping):
        report = dict(benchmark)
    else:
        with open(os.fspath(benchmark), encoding="utf-8") as f:
            report = json.load(f)
    if not isinstance(report.get("decoders"), Mapping):
        raise ValueError("`benchmark` must be a scripts/benchmark.py report (benchmark.json) with a `decoders` table.")
    return report


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def speed_table(report: Mapping[str, Any], heads_classes: Sequence[str]) -> Dict[str, Any]:
    """The rows of ``report`` that decode with heads of this kind (and the AR baseline), formatted for a card.

    A row counts when it names heads and its decoder drafts with this kind (`HEADS_DECODERS`; any decoder for heads of
    no known kind). A decoder kinds share (`SHARED_DECODERS`) counts only with heads a decoder of this kind alone used
    in the report (when there is one), so a Jacobi row with another kind's heads is left out."""
    kind = next((c for c in heads_classes if c in HEADS_DECODERS), None)
    decoders = HEADS_DECODERS.get(kind, ())
    rows = report["decoders"]
    own = {r.get("heads") for r in rows.values() if r.get("decoder_class") in decoders and r.get("decoder_class") not in SHARED_DECODERS}
    own.discard(None)

    def counts(row) -> bool:
        if not row.get("heads") or (kind is not None and row.get("decoder_class") not in decoders):
            return False
        return row["decoder_class"] not in SHARED_DECODERS or not own or row["heads"] in own

    table = [{"name": name, "exact": "yes" if row.get("exact") else "no",
              **{column: _fmt(row.get(key), spec, suffix) for column, key, spec, suffix in SPEED_COLUMNS}}
             for name, row in rows.items() if name == "ar" or counts(row)]
    sampling = report.get("sampling") or {}
    return {"rows": table, **{k: report.get(k) for k in ("model", "device", "dtype", "num_prompts", "batch_size")},
            "sampling": ", ".join(f"{k} {v}" for k, v in sampling.items() if v is not None)}


# -- draft heads -------------------------------------------------------------------------------------------
def _prefix_length(offsets: Sequence[int]) -> int:
    """The largest ``n`` with ``1..n`` all in ``offsets`` (what ``num_heads``-style decoder arguments may use)."""
    have, n = set(int(o) for o in offsets), 0
    while n + 1 in have:
        n += 1
    return n


def default_training_command(kind: Optional[str], config: Mapping[str, Any]) -> str:
    """The ``scripts/train_heads.py`` command that makes heads of this kind and config."""
    cmd = ["python", "scripts/train_heads.py"]
    horizontal, vertical = list(config.get("horizontal_offsets") or []), list(config.get("vertical_offsets") or [])
    if kind == "SpatialDraftHeads":
        cmd += ["--kind", "hawk" if vertical else "medusa", "--num-horizontal", str(max(horizontal, default=4))]
        if vertical:
            cmd += ["--vsd", str(max(vertical))]
        cmd += ["--num-layers", str(config.get("num_layers", 1))]
    elif kind == "LatentDraftHeads":
        cmd += ["--kind", "ssd", "--num-horizontal", str(max(horizontal, default=5)), "--vsd", str(max(vertical, default=2))]
        if config.get("intermediate_size"):
            cmd += ["--intermediate-size", str(config["intermediate_size"])]
    elif kind == "EagleDraftHead":
        cmd += ["--kind", "eagle"]
    else:
        return "python scripts/train_heads.py --kind medusa|hawk|ssd|eagle"
    base = config.get("base_model_name_or_path")
    if base and not os.fspath(base).replace("\\", "/").startswith(EMBEDDED_PREFIX):
        cmd += ["--model", os.fspath(base)]
    return " ".join(cmd)


def heads_card(heads_classes: Union[str, Sequence[str]], config: Mapping[str, Any], repo_id: Optional[str] = None,
               benchmark: Optional[PathOrDict] = None, training_command: Optional[str] = None,
               base_model: Optional[str] = None, **fields) -> ModelCard:
    """The adapter card of draft heads.

    Args:
        heads_classes (`str` or `list[str]`): the heads class name, or the names of its MRO (a subclass of a kind
            gets its kind's template).
        config (`dict`): the heads' config.
        repo_id (`str`, *optional*): where the heads live (Hub id or folder), for the load snippet.
        benchmark (`str`, `os.PathLike` or `dict`, *optional*): a ``scripts/benchmark.py`` report; fills the speed
            table with the rows of decoders that use this kind.
        training_command (`str`, *optional*): how the heads were trained; default: the config's
            ``training_command``, else the ``scripts/train_heads.py`` command for this kind and config.
        base_model (`str`, *optional*): the backbone's Hub id, when the config's ``base_model_name_or_path`` is not
            one (e.g. a local path to a model also on the Hub).
        fields: further template fields: ``benchmark_source`` (where the report is), ``notes`` (a markdown
            paragraph), ``example_prompt``, ``pipeline_class``.
    """
    classes = [heads_classes] if isinstance(heads_classes, str) else list(heads_classes)
    kind = next((c for c in classes if c in HEADS_TEMPLATES), None)
    config = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    base_path = config.get("base_model_name_or_path")
    base_id = base_model or hub_model_id(base_path)
    # 1. the card's metadata: an adapter of the backbone, tagged with the decoders that use this kind
    data = ModelCardData(
        library_name=LIBRARY_NAME,
        base_model=base_id,
        base_model_relation="adapter" if base_id else None,
        tags=HEADS_TAGS + HEADS_KIND_TAGS.get(kind, [])
        + (["hawk"] if kind == "SpatialDraftHeads" and config.get("vertical_offsets") else []),
    )
    # 2. the speed table, from a benchmark report
    report = load_benchmark(benchmark)
    if report is not None and "benchmark_source" not in fields and not isinstance(benchmark, Mapping):
        fields["benchmark_source"] = os.fspath(benchmark)
    # 3. the template's fields: defaults, then the caller's
    values = _heads_template_values(classes, kind, config, base_id, repo_id, training_command, report)
    values.update(fields)
    values["example_prompt"] = _literal(values["example_prompt"])
    return _render(HEADS_TEMPLATES.get(kind, GENERIC_HEADS_TEMPLATE), data, **values)


def _heads_template_values(classes, kind, config, base_id, repo_id, training_command, report) -> Dict[str, Any]:
    """The heads template's fields before the caller's ``fields``: the config's offsets, where the backbone and the
    heads live, how the heads were trained, the speed table and the defaults of the optional fields."""
    base_path = config.get("base_model_name_or_path")
    horizontal, vertical = list(config.get("horizontal_offsets") or []), list(config.get("vertical_offsets") or [])
    return dict(
        class_name=classes[0],
        kind=kind,
        config=config,
        base_model_name_or_path=os.fspath(base_path) if base_path else None,
        base_revision=config.get("base_model_revision"),
        base_ref=base_id or (os.fspath(base_path) if base_path else "<the backbone's repo id or folder>"),
        repo_ref=os.fspath(repo_id) if repo_id else "<this repo id or folder>",
        horizontal_offsets=horizontal,
        vertical_offsets=vertical,
        num_horizontal=_prefix_length(horizontal),
        num_vertical=_prefix_length(vertical),
        training_command=training_command or config.get("training_command") or default_training_command(kind, config),
        speed=speed_table(report, classes) if report is not None else None,
        benchmark_source=None,
        notes=None,
        example_prompt="a red heart",
        pipeline_class="LlamaGenPipeline",
    )


# -- pipelines ---------------------------------------------------------------------------------------------
def _public_config(obj) -> Dict[str, Any]:
    return {k: v for k, v in dict(getattr(obj, "config", {}) or {}).items() if not k.startswith("_")}


def pipeline_card(pipe, repo_id: Optional[str] = None, tags: Sequence[str] = (), license: Optional[str] = None,
                  datasets: Optional[Sequence[str]] = None, **fields) -> ModelCard:
    """The card of a `SpatialARPipeline` folder or repo.

    Args:
        pipe (`SpatialARPipeline`): the pipeline.
        repo_id (`str`, *optional*): where it lives (Hub id or folder), for the load snippet.
        tags (`list[str]`), license (`str`), datasets (`list[str]`): extra card metadata.
        fields: further template fields: ``title``, ``description`` (markdown after the title),
            ``offline_snippet`` (python code that loads it without the Hub), ``sections`` (a list of
            ``{"title": ..., "body": ...}`` markdown sections after the generic ones), ``example_prompt``.
    """
    class_name = type(pipe).__name__
    family = class_name[: -len("Pipeline")].lower() if class_name.endswith("Pipeline") else class_name.lower()
    package = getattr(pipe.config, "text_encoder_package", None) if hasattr(pipe, "config") else None
    decoder = getattr(pipe, "decoder", None)
    heads = getattr(pipe, "draft_heads", None)
    backbone = pipe.backbone
    data = ModelCardData(
        library_name=LIBRARY_NAME,
        pipeline_tag="text-to-image",
        license=license,
        datasets=list(datasets) if datasets else None,
        tags=["spatial_pipelines", family, "autoregressive", "speculative-decoding"] + [t for t in tags if t],
    )
    heads_config = _public_config(heads) if heads is not None else {}
    values = dict(
        title=f"{class_name} for spatial_pipelines",
        class_name=class_name,
        family=family,
        repo_ref=os.fspath(repo_id) if repo_id else "<this repo id or folder>",
        packages=[LIBRARY_NAME] + ([package] if package else []),
        text_encoder_package=package,
        text_encoder_class=type(pipe.text_encoder).__name__ if getattr(pipe, "text_encoder", None) is not None else None,
        decoder_class=type(decoder).__name__ if decoder is not None else None,
        decoder_config=_public_config(decoder) if decoder is not None else {},
        heads_class=type(heads).__name__ if heads is not None else None,
        heads_base=hub_model_id(heads_config.get("base_model_name_or_path")) or heads_config.get("base_model_name_or_path"),
        heads_offsets={k: heads_config[k] for k in ("horizontal_offsets", "vertical_offsets") if heads_config.get(k)},
        facts=backbone.facts(),
        guidance_scale=backbone.default_guidance_scale,
        top_k=backbone.default_top_k,
        description=None,
        offline_snippet=None,
        sections=[],
        example_prompt=207 if getattr(getattr(getattr(pipe, "transformer", None), "config", None), "condition_type", None) == "class" else "a red heart",
    )
    values.update(fields)
    values["example_prompt"] = _literal(values["example_prompt"])
    return _render(PIPELINE_TEMPLATE, data, **values)
