"""The pipeline every family shares (`SpatialARPipeline`): its components (backbone adapter, decoder, draft heads),
loading and saving, and the numbered steps of a call with diffusers' conventions around them. Beside it: a call's
checks (`call_checks.py`), the loop's settings (`loop_settings.py`), outputs (`pipeline_output.py`), the backbone
contract (`backbone.py`), "auto" sizes (`pass_cost.py`), Hub saving (`spatial_pipelines.hub`). Pipeline classes are
read off the loaded classes (`family_pipelines`) and bound on diffusers' tables as they are defined."""

import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from diffusers import DiffusionPipeline
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils import logging

from ..core.sampling import SamplingConfig
from ..decoders.decoding_autoregressive import AutoregressiveDecoder
from ..decoders.decoding_utils import SpatialDecoderMixin
from ..heads.heads_utils import DraftHeadsMixin
from ..hub import pipeline_card, push_with_card, save_with_card
from ..utils import check_path_or_repo_id, check_safe_serialization, check_weights_folder, subclasses
from .backbone import PromptEmbeddings, SpatialBackbone
from .call_checks import CallChecksMixin, PromptInput, as_list
from .callbacks import CallbackStateMixin
from .generation import LoopHooks
from .loop_settings import LoopSettingsMixin
from .pass_cost import DraftSizingMixin
from .pipeline_output import DecodingStats, SpatialPipelineOutput

logger = logging.get_logger(__name__)


class SpatialARPipeline(CallbackStateMixin, DraftSizingMixin, CallChecksMixin, LoopSettingsMixin, DiffusionPipeline):
    r"""Base of the AR image pipelines: the generation loop, written once for every family and decoder.

    Components of a family pipeline: the backbone's modules, a ``decoder`` (a `SpatialDecoderMixin`: the
    speculative decoding algorithm, swappable like a diffusers scheduler) and optional ``draft_heads``.
    """

    backbone_class: type = None
    #: What `from_pretrained` checks a folder with before anything is loaded from it (``_folder_check(cls, folder,
    #: variant, passed)`` returns the components to pass on): `folder_checks.check_pipeline_folder`, which looks this
    #: class's subclasses up, so it is set where the package binds its modules (`spatial_pipelines.pipelines`).
    _folder_check: Callable[..., Dict[str, Any]] = None

    def __init_subclass__(cls, **kwargs):
        """A family defined anywhere (a user's module, a test) is found by ``DiffusionPipeline.from_pretrained`` and
        ``AutoPipelineForText2Image`` as the shipped ones are."""
        super().__init_subclass__(**kwargs)
        bind_pipelines_on_diffusers()
        register_auto_pipelines()

    # -- components -------------------------------------------------------------------------------------
    @property
    def backbone(self) -> SpatialBackbone:
        """The family adapter over the current components, built once per pipeline: it reads the components when
        asked (a swapped one is seen) and owns what is kept between calls (`BackboneCaches`)."""
        adapter = self.__dict__.get("_backbone")
        if adapter is None or adapter.pipe is not self or type(adapter) is not self.backbone_class:  # a copied pipeline
            adapter = self.__dict__["_backbone"] = self.backbone_class(self)
        return adapter

    @property
    def image_processor(self) -> VaeImageProcessor:
        return VaeImageProcessor(vae_scale_factor=self.backbone.vae_scale_factor, do_normalize=True)

    def __setattr__(self, name: str, value: Any):
        """``pipe.decoder = ...`` and ``pipe.draft_heads = ...`` (the ``pipe.scheduler = ...`` habit) get the checks of
        `set_draft_heads`: a non-decoder, or heads made for another backbone, is a `ValueError`; heads move to the
        backbone's device and dtype."""
        if name in self.__dict__ and name == "decoder" and not isinstance(value, SpatialDecoderMixin):
            hint = f"; by name: `DECODERS[{value!r}]()` from `spatial_pipelines.decoders`" if isinstance(value, str) else ""
            raise ValueError(f"`decoder` must be a decoder instance (a SpatialDecoderMixin such as `MedusaDecoder()`), got {value!r}{hint}.")
        if name in self.__dict__ and name == "draft_heads":
            self._prepare_draft_heads(value)
            if value is not None:  # diffusers keeps (None, None) for a component once set to None: record it again
                from diffusers.pipelines.pipeline_loading_utils import _fetch_class_library_tuple

                self.register_to_config(draft_heads=_fetch_class_library_tuple(value))
        heads = self.__dict__.get("draft_heads")
        if (name in self.__dict__ and heads is not None and name not in ("decoder", "draft_heads")
                and isinstance(self.__dict__[name], torch.nn.Module)):
            # a backbone component swapped under attached heads: they must still fit it, or nothing changes
            old = self.__dict__[name]
            super().__setattr__(name, value)
            try:
                self._check_heads_fit(heads)
            except ValueError as err:
                super().__setattr__(name, old)
                raise ValueError(f"`{name}`: the new {type(value).__name__} does not fit the attached draft heads "
                                 f"(detach them first with `pipe.draft_heads = None`). {err}") from None
            except Exception:  # a component the backbone cannot read yet: the call's checks will say
                pass
            return
        super().__setattr__(name, value)

    def _check_heads_fit(self, draft_heads: DraftHeadsMixin) -> None:
        """Raise `ValueError` naming what differs when ``draft_heads`` were made for another backbone: family, base
        model, hidden size, code count or grid (`DraftHeadsMixin.check_backbone`)."""
        backbone = self.backbone
        draft_heads.check_backbone(backbone.facts(), base_model=backbone.name_or_path)

    def _prepare_draft_heads(self, draft_heads) -> None:
        """Check ``draft_heads`` fit the backbone, then move them to its device and dtype (``None``: nothing)."""
        if draft_heads is None:
            return
        if not isinstance(draft_heads, DraftHeadsMixin):
            raise ValueError(f"`draft_heads` must be a `DraftHeadsMixin` (e.g. `SpatialDraftHeads`), got {type(draft_heads).__name__}.")
        self._check_heads_fit(draft_heads)
        # like an adapter, the heads take the backbone's device and dtype (fp32 heads drive a bf16 backbone);
        # nn.Module.to: diffusers' ModelMixin.to warns on every dtype cast, even with no fp32-only modules
        torch.nn.Module.to(draft_heads, device=self.device, dtype=self.backbone.dtype)

    def set_draft_heads(self, draft_heads: Optional[DraftHeadsMixin]) -> None:
        """Attach (or with ``None`` detach) draft heads, checked and moved as `_prepare_draft_heads` does."""
        self._prepare_draft_heads(draft_heads)
        self.register_modules(draft_heads=draft_heads)

    def load_draft_heads(self, pretrained_model_name_or_path: Union[str, os.PathLike], **kwargs) -> DraftHeadsMixin:
        """Load draft heads saved with ``save_pretrained``/``push_to_hub`` and attach them: their config is checked
        against this backbone before any weight is read (`ValueError`). Keyword arguments go to ``from_pretrained``."""
        backbone = self.backbone
        heads = DraftHeadsMixin.from_pretrained(pretrained_model_name_or_path, backbone_facts=backbone.facts(),
                                                base_model=backbone.name_or_path, **kwargs)
        self.set_draft_heads(heads)
        return heads

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' ``from_pretrained`` (a folder or a Hub repo id, downloaded as safetensors only), after checking
        the folder against itself before any weight is used (`spatial_pipelines.pipelines.folder_checks`: classes,
        configs, whole safetensors of the shapes the configs build; each finding a `ValueError` naming file and key)."""
        path = pretrained_model_name_or_path
        check_path_or_repo_id(path, "pretrained_model_name_or_path")
        kwargs["use_safetensors"] = True  # never a pickled .bin in place of a missing safetensors file
        folder = os.fspath(path)
        if not os.path.isdir(folder):
            download = {k: kwargs[k] for k in ("cache_dir", "force_download", "proxies", "local_files_only", "token",
                                                "revision", "variant") if k in kwargs}
            folder = cls.download(folder, use_safetensors=True, **download)
        check_weights_folder(folder, "pipeline weights")
        preloaded = cls._folder_check(cls, folder, kwargs.get("variant"), passed=set(kwargs))
        for name, component in preloaded.items():
            kwargs.setdefault(name, component)
        pipe = super().from_pretrained(folder, **kwargs)
        pipe.register_to_config(_name_or_path=os.fspath(path))
        return pipe

    @classmethod
    def from_backbone(cls, repo_or_path: Union[str, os.PathLike], decoder: Optional[SpatialDecoderMixin] = None,
                      draft_heads: Union[None, str, os.PathLike, DraftHeadsMixin] = None,
                      **kwargs) -> "SpatialARPipeline":
        """Build a pipeline from a plain backbone checkpoint (no ``model_index.json``).

        Args:
            repo_or_path: the family's original checkpoint (see the family's ``load_backbone_components``).
            decoder (`SpatialDecoderMixin`, *optional*): defaults to `AutoregressiveDecoder`.
            draft_heads: a heads object, or a path/repo to load them from.
            kwargs: family-specific loading options.
        """
        components = cls.load_backbone_components(repo_or_path, **kwargs)
        pipe = cls(**components, decoder=decoder if decoder is not None else AutoregressiveDecoder())
        pipe.register_to_config(_name_or_path=str(repo_or_path))
        if isinstance(draft_heads, (str, os.PathLike)):
            pipe.load_draft_heads(draft_heads)
        elif draft_heads is not None:
            pipe.set_draft_heads(draft_heads)
        return pipe

    @classmethod
    def load_backbone_components(cls, repo_or_path, **kwargs) -> Dict[str, Any]:
        """Family hook for `from_backbone`: the backbone components read from an original checkpoint."""
        raise ValueError(f"{cls.__name__} has no loader for plain backbone checkpoints; use `from_pretrained`.")

    def save_pretrained(self, save_directory: Union[str, os.PathLike], safe_serialization: bool = True, **kwargs):
        """Save every component (safetensors only) and a model card (``README.md``, `hub.pipeline_card`) all at once: a
        failed save leaves the folder as it was. With ``push_to_hub=True`` the folder is then uploaded to ``repo_id``
        (default: the folder's name; ``private``, ``token``, ``commit_message``, ``create_pr`` as in diffusers);
        without it ``repo_id`` only names the repo in the card. ``model_card=False`` writes no card; ``card_fields``
        (a dict) go to `pipeline_card`."""
        check_safe_serialization(safe_serialization)
        write_card = kwargs.pop("model_card", True)
        card_fields = kwargs.pop("card_fields", None) or {}
        packaged = {name: getattr(self.config, name) for name in self._packaged_components()}

        def write(folder):
            # components that come from an installed package are recorded as absent and never written (diffusers'
            # save skips an absent component only when it is optional)
            self.register_to_config(**{name: (None, None) for name in packaged})
            own = self.__dict__.get("_optional_components")
            self._optional_components = list(dict.fromkeys([*self._optional_components, *packaged]))
            try:
                super(SpatialARPipeline, self).save_pretrained(folder, safe_serialization=True, **kwargs)
            finally:
                self.register_to_config(**packaged)
                if own is None:
                    del self._optional_components
                else:
                    self._optional_components = own

        return save_with_card(self, save_directory, kwargs, write,
                              (lambda repo_id: pipeline_card(self, repo_id=repo_id, **card_fields)) if write_card else None)

    def push_to_hub(self, repo_id: str, commit_message: Optional[str] = None, private: Optional[bool] = None,
                    token: Optional[str] = None, create_pr: bool = False, safe_serialization: bool = True,
                    variant: Optional[str] = None, subfolder: Optional[str] = None, **card_fields) -> str:
        """Upload the pipeline to the Hub repo ``repo_id``: the files ``save_pretrained(..., push_to_hub=True)`` sends
        (our model card, not diffusers' generic one). Arguments as diffusers' `PushToHubMixin.push_to_hub`; further
        keyword arguments go to `pipeline_card`."""
        return push_with_card(self, repo_id, dict(variant=variant, card_fields=card_fields), private=private, token=token,
                              commit_message=commit_message, create_pr=create_pr, subfolder=subfolder,
                              safe_serialization=safe_serialization)

    def _packaged_components(self) -> List[str]:
        """Components loaded from an installed package rather than from the pipeline folder."""
        return []

    # -- the loop ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(
        self,
        prompt: PromptInput,
        negative_prompt: Optional[PromptInput] = None,
        guidance_scale: Optional[float] = None,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        num_images_per_prompt: int = 1,
        generator: Union[None, torch.Generator, List[torch.Generator]] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Optional[Callable[["SpatialARPipeline", int, int, Dict[str, Any]], Dict[str, Any]]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("tokens",),
        sampling_noise: Optional[str] = None,
    ):
        r"""Generate images.

        Args:
            prompt (`str`, `int` or a list of them): text prompts, or class labels for class-conditional models.
            negative_prompt (*optional*): replaces the unconditional prompt of CFG (one, or one per prompt).
            guidance_scale (`float`, *optional*): CFG scale ``s`` in ``uncond + s * (cond - uncond)``; 1 disables CFG.
            temperature (`float`): 0 is greedy. top_k (`int`, *optional*): keep the ``k`` most likely codes (0: all).
            top_p (`float`, *optional*): nucleus filtering. Unset ``guidance_scale`` / ``top_k``: the family's.
            num_images_per_prompt (`int`): images per prompt.
            generator (`torch.Generator` or a list, one per image): a list makes each image reproducible alone.
            output_type (`str`): ``"pil"``, ``"np"``, ``"pt"`` or ``"latent"`` (the token grids).
            return_dict (`bool`): return a `SpatialPipelineOutput` rather than a tuple.
            callback_on_step_end (`Callable`, *optional*): ``callback(pipe, step_index, num_committed,
                callback_kwargs)`` after every round, as in diffusers (the contract: `CallbackStateMixin`).
            callback_on_step_end_tensor_inputs (`list[str]`): state tensors put in ``callback_kwargs``.
            sampling_noise (`str`, *optional*): ``"keyed"`` (noise keyed by each image's seed and grid position: every
                exact decoder gives AR's image for a seed), ``"drawn"``, or ``None``: keyed where the decoder can.

        Returns:
            `SpatialPipelineOutput` (or ``(images, tokens, stats)``).
        """
        start_time = time.perf_counter()
        # 1. Check inputs (the family's defaults filled in)
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):  # as diffusers: its own inputs
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        prompts, sampling = self._check_call(
            prompt, negative_prompt, guidance_scale, temperature, top_k, top_p, num_images_per_prompt, generator,
            output_type, return_dict, callback_on_step_end_tensor_inputs, callback_on_step_end, sampling_noise,
        )
        # 2. Encode prompts: one row per image, then (with CFG) the unconditional rows
        prefix = self._encode_prompts(prompts, negative_prompt, num_images_per_prompt, sampling, self._execution_device)
        # 3-5. The cache, the prompt pass and the rounds (`_generate`)
        flat, stats = self._generate(prefix, sampling, generator, len(prompts) * num_images_per_prompt,
                                     callback_on_step_end, callback_on_step_end_tensor_inputs)
        # 6. VQ decode, 7. post-process
        tokens = self.backbone.layout.grid(flat)  # (B, H, W)
        images = tokens if output_type == "latent" else self._decode(tokens, output_type)
        self.maybe_free_model_hooks()
        stats.wall_time_s = time.perf_counter() - start_time
        return SpatialPipelineOutput(images=images, tokens=tokens, stats=stats) if return_dict else (images, tokens, stats)

    def _generate(self, prefix: PromptEmbeddings, sampling: SamplingConfig, generator, batch_size: int, callback,
                  tensor_inputs) -> Tuple[torch.Tensor, DecodingStats]:
        """Steps 3-5: the draft sizes ("auto": measured), then the loop (`GenerationLoop.generate`) with diffusers'
        progress bar and callback. Returns the grids ``(B, N)`` and the stats."""
        self.check_prompt_length(prefix.embeds.shape[1])  # (R, P, D)
        self._start_call(sampling.guidance_scale, sampling.do_cfg)  # `guidance_scale`, `num_timesteps`, `interrupt`
        self.resolve_draft_sizes(batch_size, sampling, prefix.embeds.shape[1])
        on_round = None if callback is None else (
            lambda step_index, batch: self._run_callback(callback, tensor_inputs, step_index, batch))
        hooks = LoopHooks(progress_bar=self.progress_bar, on_round=on_round, interrupted=lambda: self.interrupt,
                          rounds_known=lambda n: setattr(self, "_num_timesteps", n))
        return self.loop.generate(self.decoder, self.draft_heads, prefix, sampling, generator, batch_size, hooks)

    # -- the loop's steps -------------------------------------------------------------------------------
    def _check_call(self, prompt, negative_prompt, guidance_scale, temperature, top_k, top_p, num_images_per_prompt,
                    generator, output_type, return_dict, tensor_inputs, callback, sampling_noise):
        """Step 1: every argument checked before any work (`check_inputs`), the decoder and heads against the backbone,
        the memory the batch needs; returns the prompts and the `SamplingConfig` (the family's defaults filled in)."""
        self.check_components()
        backbone = self.backbone
        guidance_scale = backbone.default_guidance_scale if guidance_scale is None else guidance_scale
        top_k = backbone.default_top_k if top_k is None else top_k
        prompts = self.check_inputs(prompt, negative_prompt, guidance_scale, temperature, top_k, top_p,
                                    num_images_per_prompt, generator, output_type, tensor_inputs, callback, sampling_noise)
        if not isinstance(return_dict, bool):
            raise ValueError(f"`return_dict` must be True or False, got {return_dict!r}.")
        self.decoder.check_compatibility(backbone.layout, self.draft_heads)
        if self.draft_heads is not None and self.decoder.heads_needed() is None:
            logger.warning(f"The pipeline's draft heads ({type(self.draft_heads).__name__}) are not used by "
                           f"{type(self.decoder).__name__}, which drafts without heads.")
        if sampling_noise is None:
            sampling_noise = "keyed" if self.decoder.supports_keyed_noise else "drawn"
        sampling = SamplingConfig(guidance_scale, temperature, top_k, top_p, noise=sampling_noise)
        self.check_memory(len(prompts) * num_images_per_prompt, sampling.do_cfg)
        return prompts, sampling

    def _encode_prompts(self, prompts, negative_prompt, num_images_per_prompt: int, sampling: SamplingConfig,
                        device: torch.device) -> PromptEmbeddings:
        """Step 2: one conditional row per image, then (with CFG) one unconditional row per image."""
        prompt_rows = [p for p in prompts for _ in range(num_images_per_prompt)]
        negative_rows = None
        if negative_prompt is not None:
            negatives = as_list(negative_prompt) * (len(prompts) if len(as_list(negative_prompt)) == 1 else 1)
            negative_rows = [n for n in negatives for _ in range(num_images_per_prompt)]
        return self.backbone.encode_prompt(prompt_rows, negative_rows, sampling.do_cfg, device)

    def _decode(self, tokens: torch.Tensor, output_type: str):
        """Steps 6-7: VQ-decode the grids ``(B, H, W)`` and post-process the pixels with `VaeImageProcessor`. After an
        `interrupt`, codes not decoded (``-1``) are decoded as code 0 and their pixels painted mid-grey."""
        if not self.interrupt:
            pixels = self.backbone.decode_image(tokens)  # (B, 3, h, w) in [-1, 1]
        else:
            pixels = self.backbone.decode_image(tokens.clamp_min(0))
            undecoded = torch.nn.functional.interpolate((tokens < 0)[:, None].float(), size=pixels.shape[-2:]) > 0.5  # (B, 1, h, w)
            pixels = pixels.masked_fill(undecoded, 0.0)
        return self.image_processor.postprocess(pixels.float(), output_type=output_type)


def family_pipelines() -> Dict[str, type]:
    """``{family: pipeline class}``: every loaded `SpatialARPipeline` subclass that defines its own
    ``dummy_components`` (the tiny random components `spatial_pipelines.testing.dummy_pipeline` builds it from), keyed by
    its backbone's ``family``. Bases shared by several families (`ChameleonARPipeline`) define none."""
    found = {}
    for cls in subclasses(SpatialARPipeline):
        if "dummy_components" in cls.__dict__ and cls.backbone_class is not None:
            found.setdefault(cls.backbone_class.family, cls)
    return found


def register_auto_pipelines() -> None:
    """Make ``AutoPipelineForText2Image.from_pretrained`` resolve every `SpatialARPipeline` subclass by the
    ``_class_name`` of a saved folder (diffusers matches the class name against its text-to-image table)."""
    from diffusers.pipelines import auto_pipeline

    for cls in subclasses(SpatialARPipeline):
        auto_pipeline.AUTO_TEXT2IMAGE_PIPELINES_MAPPING.setdefault(f"spatial-pipelines-{cls.__name__}", cls)


def bind_pipelines_on_diffusers() -> None:
    """Make every `SpatialARPipeline` subclass resolvable as ``diffusers.<ClassName>`` (never replacing a diffusers name)."""
    import diffusers

    for cls in subclasses(SpatialARPipeline):
        try:
            getattr(diffusers, cls.__name__)  # a diffusers name (lazily importable too) is never replaced
        except AttributeError:
            setattr(diffusers, cls.__name__, cls)
