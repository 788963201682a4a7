"""The pipeline every family shares (`SpatialARPipeline`): input checks, prompt encoding, VQ decoding and diffusers'
conventions around the generation loop (`generation.GenerationLoop`: the cache, the rounds, fixed shapes, compile).
Its output types live in `pipeline_output.py`, the backbone contract in `backbone.py`, the costs behind "auto" sizes
in `pass_cost.py`, Hub saving in `spatial_pipelines.hub`."""

import collections.abc
import inspect
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from diffusers import DiffusionPipeline
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils import logging

from ..core.sampling import SAMPLING_NOISE, SamplingConfig
from ..decoders.decoding_autoregressive import AutoregressiveDecoder
from ..decoders.decoding_utils import SpatialDecoderMixin
from ..heads.heads_utils import DraftHeadsMixin
from ..utils import check_number, check_path_or_repo_id, check_safe_serialization, check_weights_folder
from .backbone import PromptEmbeddings, SpatialBackbone
from .callbacks import CallbackStateMixin
from .generation import GenerationLoop, LoopHooks, check_rounds_per_sync
from .pass_cost import DraftSizingMixin
from .pipeline_output import DecodingStats, SpatialPipelineOutput

logger = logging.get_logger(__name__)

#: The largest `guidance_scale` a call takes: beyond it ``uncond + s * (cond - uncond)`` overflows fp32 logits.
MAX_GUIDANCE_SCALE = 1e4

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
PromptInput = Union[str, int, Sequence[Union[str, int]]]


class SpatialARPipeline(CallbackStateMixin, DraftSizingMixin, DiffusionPipeline):
    r"""Base of the AR image pipelines: the generation loop, written once for every family and decoder.

    Components of a family pipeline: the backbone's modules, a ``decoder`` (a `SpatialDecoderMixin`: the
    speculative decoding algorithm, swappable like a diffusers scheduler) and optional ``draft_heads``.
    """

    backbone_class: type = None

    def __init_subclass__(cls, **kwargs):
        """A family defined anywhere (a user's module, a test) is found by ``DiffusionPipeline.from_pretrained`` and
        ``AutoPipelineForText2Image`` as the shipped ones are (`spatial_pipelines._registration`)."""
        super().__init_subclass__(**kwargs)
        from .._registration import bind_pipelines_on_diffusers, register_auto_pipelines

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
        """Attach (or with ``None`` detach) draft heads after checking they fit the backbone. Like an adapter, the
        heads move to the backbone's device and dtype (heads trained in fp32 drive a bf16 backbone)."""
        self._prepare_draft_heads(draft_heads)
        self.register_modules(draft_heads=draft_heads)

    def load_draft_heads(self, pretrained_model_name_or_path: Union[str, os.PathLike], **kwargs) -> DraftHeadsMixin:
        """Load draft heads saved with ``save_pretrained``/``push_to_hub`` and attach them.

        The heads' config is checked against this backbone before any weight is read; a mismatch raises
        `ValueError`. Keyword arguments go to the heads class's ``from_pretrained``.
        """
        backbone = self.backbone
        heads = DraftHeadsMixin.from_pretrained(pretrained_model_name_or_path, backbone_facts=backbone.facts(),
                                                base_model=backbone.name_or_path, **kwargs)
        self.set_draft_heads(heads)
        return heads

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' ``from_pretrained`` (a folder or a Hub repo id), after checking the folder against itself before any
        weight is used (`spatial_pipelines.pipelines.folder_checks`): JSON files, ``model_index.json`` and the
        components' configs name classes that exist and agree (a component's own config wins over
        ``model_index.json``, with a warning), config values have their types and ranges, weights are whole
        safetensors (never a pickle) whose names and shapes the configs build. Each finding is a `ValueError` naming
        the file and the key. A Hub repo is downloaded (safetensors only) and checked the same way."""
        from .folder_checks import check_pipeline_folder

        path = pretrained_model_name_or_path
        check_path_or_repo_id(path, "pretrained_model_name_or_path")
        kwargs["use_safetensors"] = True  # never a pickled .bin in place of a missing safetensors file
        folder = os.fspath(path)
        if not os.path.isdir(folder):
            download = {k: kwargs[k] for k in ("cache_dir", "force_download", "proxies", "local_files_only", "token",
                                                "revision", "variant") if k in kwargs}
            folder = cls.download(folder, use_safetensors=True, **download)
        check_weights_folder(folder, "pipeline weights")
        preloaded = check_pipeline_folder(cls, folder, kwargs.get("variant"), passed=set(kwargs))
        for name, component in preloaded.items():
            kwargs.setdefault(name, component)
        pipe = super().from_pretrained(folder, **kwargs)
        pipe.register_to_config(_name_or_path=os.fspath(path))
        return pipe

    @classmethod
    def from_backbone(
        cls,
        repo_or_path: Union[str, os.PathLike],
        decoder: Optional[SpatialDecoderMixin] = None,
        draft_heads: Union[None, str, os.PathLike, DraftHeadsMixin] = None,
        **kwargs,
    ) -> "SpatialARPipeline":
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
        """Save every component (safetensors only) and a model card (``README.md``, `spatial_pipelines.hub.pipeline_card`:
        what the pipeline is, the packages loading it needs, how to load it) all at once: a failed save leaves the
        folder as it was.

        With ``push_to_hub=True`` the folder is then uploaded to ``repo_id`` (default: the folder's name; ``private``,
        ``token``, ``commit_message`` and ``create_pr`` as in diffusers): the same files `push_to_hub` sends. Without
        it, ``repo_id`` only names the repo in the card's load snippet. ``model_card=False`` writes no card;
        ``card_fields`` (a dict) go to `pipeline_card` (``description``, ``sections``, ``license``, ...).
        """
        from ..hub import pipeline_card, save_with_card

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

    def push_to_hub(
        self,
        repo_id: str,
        commit_message: Optional[str] = None,
        private: Optional[bool] = None,
        token: Optional[str] = None,
        create_pr: bool = False,
        safe_serialization: bool = True,
        variant: Optional[str] = None,
        subfolder: Optional[str] = None,
        **card_fields,
    ) -> str:
        """Upload the pipeline to the Hub repo ``repo_id``: every component (safetensors) and our model card (not
        diffusers' generic one), the files ``save_pretrained(..., push_to_hub=True)`` sends.

        Arguments as diffusers' `PushToHubMixin.push_to_hub`; further keyword arguments go to `pipeline_card`.
        """
        from ..hub import push_with_card

        def save(folder, full_id):
            self.save_pretrained(folder, variant=variant, repo_id=full_id, card_fields=card_fields)

        return push_with_card(self, repo_id, save, private=private, token=token, commit_message=commit_message,
                              create_pr=create_pr, subfolder=subfolder, safe_serialization=safe_serialization)

    def _packaged_components(self) -> List[str]:
        """Components loaded from an installed package rather than from the pipeline folder."""
        return []

    # -- the loop's settings ------------------------------------------------------------------------------
    @property
    def loop(self) -> GenerationLoop:
        """The generation loop (`GenerationLoop`: cache, prompt pass, rounds, fixed shapes, compile, syncs), built once
        per pipeline over its backbone adapter; a copied pipeline builds its own with the same settings."""
        loop = self.__dict__.get("_loop")
        backbone = self.backbone
        if loop is None or loop.backbone is not backbone:
            settings = loop.settings() if loop is not None else {}
            loop = self.__dict__["_loop"] = GenerationLoop(backbone)
            for name, value in settings.items():
                setattr(loop, name, value)
        return loop

    @property
    def static_shapes(self) -> bool:
        """Whether every round of a generation runs the target with a few fixed shapes: the KV cache (its length rounded
        up) attended over one of at most ``attend_buckets`` fixed lengths and every draft padded to the decoder's
        largest (`static_shapes` module). On by default when the target is compiled (`enable_compile`), off otherwise
        (eager, the growing slice is cheaper). Set it to ``True``/``False`` to choose, ``None`` for the default.
        Outputs are the same either way."""
        return self.loop.static_shapes

    @static_shapes.setter
    def static_shapes(self, value: Optional[bool]) -> None:
        self.loop.static_shapes_setting = _check_optional_bool("static_shapes", value, "the default: on when compiled")

    @property
    def device_rounds(self) -> Optional[bool]:
        """Rounds run whole on the device where the decoder allows (`GenerationLoop.device_plan`: keyed noise or greedy,
        no ``callback_on_step_end``); ``False``: always the row-group loop (every decoder's own `propose` and `step`)."""
        return self.loop.device_rounds

    @device_rounds.setter
    def device_rounds(self, value: Optional[bool]) -> None:
        self.loop.device_rounds = _check_optional_bool("device_rounds", value, "where the decoder allows")

    @property
    def max_rounds_per_sync(self) -> int:
        """Rounds on the device run between two host reads at most (``K``; default `MAX_ROUNDS_PER_SYNC`, 8). The
        loop runs the fewest rounds the slowest row still needs, up to ``K``, then reads once: a larger ``K`` reads
        less often, and between reads each pass attends to up to ``K`` rounds of slots no row has filled yet."""
        return self.loop.max_rounds_per_sync

    @max_rounds_per_sync.setter
    def max_rounds_per_sync(self, value: int) -> None:
        self.loop.max_rounds_per_sync = check_rounds_per_sync(value)

    @property
    def is_compiled(self) -> bool:
        return self.loop.is_compiled

    def enable_compile(self, mode: Optional[str] = None, dynamic: bool = False, fullgraph: Optional[bool] = None,
                       backend: str = "inductor", keep_if_slower: bool = False, measure: bool = True, **kwargs) -> Dict[str, Any]:
        """Compile the round's target step once per shape, and keep it unless it measures slower.

        With the target compiled, `static_shapes` is on: every round of a generation feeds the same number of slots
        and attends to one of a few fixed lengths (`StaticKVCache`'s ``attend_buckets``), so a handful of graphs (one
        per length reached) serve the whole generation and every later one of the same batch, draft size and cache
        size; a new prompt length compiles nothing (the prefill runs eagerly). A round that runs whole on the device
        (`GenerationLoop.device_plan`) is compiled whole with the same options (``fullgraph=True``). The first round
        of each new shape compiles (tens of seconds with inductor on a CPU). Dynamo's per-function recompile limit is
        raised to at least `RECOMPILE_LIMIT` (64), since swapping decoders adds graphs.

        Args:
            mode (`str`, *optional*): ``torch.compile``'s mode; default ``"reduce-overhead"`` (CUDA graphs) on a GPU
                with inductor, none otherwise.
            dynamic (`bool`): ``False`` (the default): static shapes, one graph per shape.
            fullgraph (`bool`, *optional*): no graph breaks allowed; default: the backbone's ``supports_fullgraph``.
            backend (`str`): ``"inductor"``, or ``"eager"`` / ``"aot_eager"`` to check graphs and recompiles quickly.
            keep_if_slower (`bool`): keep the compiled step even when it measures slower (by default it is dropped
                when its passes take more than `COMPILE_TOLERANCE`, 5%, longer than the eager ones: the compiled
                round also drops the eager ops around the pass, which that timing does not see).
            measure (`bool`): time the eager and compiled passes (one fed token and eight, CFG rows, after warming up)
                and drop the compiled step when it is slower (above); ``False`` keeps it unmeasured.
            kwargs: further ``torch.compile`` options.

        Returns:
            ``{"eager_ms": {T: ms}, "compiled_ms": {T: ms}, "enabled": bool, "kept_by_default": bool, "options":
            {...}}``: ``kept_by_default`` says whether the measured rule alone keeps it (what ``keep_if_slower=False``
            decides; no timings when ``measure=False``).
        """
        return self.loop.compile(self._execution_device, mode=mode, dynamic=dynamic, fullgraph=fullgraph,
                                 backend=backend, keep_if_slower=keep_if_slower, measure=measure, **kwargs)

    def disable_compile(self) -> None:
        """Undo `enable_compile`: the target forward runs eagerly again."""
        self.loop.disable_compile()

    def profile_rounds(self, synchronize: Optional[Callable[[], None]] = None):
        """Time every part of every round of the calls made inside the block (``scripts/bench_cost.py``); they run
        in row groups, whose parts are separate.

        Yields a `RoundTimer`: ``seconds`` per section (``draft``, ``eol``, ``forward``, ``accept``, ``kv``, and
        ``round`` for the whole round) summed over ``rounds``. On a GPU pass ``synchronize=torch.cuda.synchronize``.
        """
        return self.loop.profile_rounds(synchronize)

    # -- inputs -----------------------------------------------------------------------------------------
    def check_inputs(
        self,
        prompt,
        negative_prompt,
        guidance_scale,
        temperature,
        top_k,
        top_p,
        num_images_per_prompt,
        generator,
        output_type,
        callback_on_step_end_tensor_inputs,
        callback_on_step_end=None,
        sampling_noise=None,
    ) -> List[Any]:
        """Validate the call's arguments; returns the prompt as a list. Raises `ValueError` naming the argument."""
        prompts = _as_list(prompt, "prompt")
        if len(prompts) == 0:
            raise ValueError("`prompt` must hold at least one prompt, got an empty list.")
        backbone = self.backbone
        backbone.check_prompt(prompts, "prompt")
        _check_text(prompts, "prompt", backbone.max_prompt_characters)
        if negative_prompt is not None:
            negatives = _as_list(negative_prompt, "negative_prompt")
            if len(negatives) not in (1, len(prompts)):
                raise ValueError(
                    f"`negative_prompt` must hold 1 or len(prompt)={len(prompts)} prompts, got {len(negatives)}."
                )
            backbone.check_prompt(negatives, "negative_prompt")
            _check_text(negatives, "negative_prompt", backbone.max_prompt_characters)
        check_number("guidance_scale", guidance_scale, 0, MAX_GUIDANCE_SCALE, meaning="1 disables guidance; beyond "
                     f"{MAX_GUIDANCE_SCALE:g} the mixed fp32 logits overflow")
        if negative_prompt is not None and guidance_scale == 1:
            raise ValueError("`negative_prompt` is only used by classifier-free guidance, which `guidance_scale=1` turns "
                             "off: pass a `guidance_scale` other than 1, or no `negative_prompt`.")
        check_number("temperature", temperature, 0, meaning="0 is greedy")
        check_number("top_k", top_k, 0, integer=True, optional=True, meaning="0 keeps every code")
        check_number("top_p", top_p, 0, 1, low_open=True, optional=True)
        check_number("num_images_per_prompt", num_images_per_prompt, 1, integer=True)
        _check_generator(generator, len(prompts), num_images_per_prompt)
        if sampling_noise is not None and (not isinstance(sampling_noise, str) or sampling_noise not in SAMPLING_NOISE):
            raise ValueError(f"`sampling_noise` must be one of {SAMPLING_NOISE} or None (keyed where the decoder "
                             f"supports it), got {sampling_noise!r}.")
        if sampling_noise == "keyed" and not self.decoder.supports_keyed_noise:
            raise ValueError(f"`sampling_noise='keyed'` needs an exact decoder that tests drafts against the target's "
                             f"sample; {type(self.decoder).__name__} with its config (a relaxed acceptance rule, or SSD) "
                             "draws from the generators: pass `sampling_noise='drawn'` or None.")
        if not isinstance(output_type, str) or output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        self._check_callback(callback_on_step_end, callback_on_step_end_tensor_inputs)
        return prompts

    def _check_callback(self, callback_on_step_end, callback_on_step_end_tensor_inputs) -> None:
        """`check_inputs`' part for ``callback_on_step_end`` and the state tensors it is given."""
        if callback_on_step_end is not None and not callable(callback_on_step_end):
            raise ValueError(f"`callback_on_step_end` must be callable or None, got {type(callback_on_step_end).__name__}.")
        if callback_on_step_end is not None:
            _check_callback_signature(callback_on_step_end)
        if callback_on_step_end_tensor_inputs is None or not isinstance(callback_on_step_end_tensor_inputs, (list, tuple, str)):
            raise ValueError(f"`callback_on_step_end_tensor_inputs` must be a list of names (`[]` for none), got "
                             f"{callback_on_step_end_tensor_inputs!r}; allowed names: {self._callback_tensor_inputs}.")
        if isinstance(callback_on_step_end_tensor_inputs, str):
            raise ValueError(f"`callback_on_step_end_tensor_inputs` must be a list of names, got the string {callback_on_step_end_tensor_inputs!r}.")
        unknown = [k for k in callback_on_step_end_tensor_inputs or () if k not in self._callback_tensor_inputs]
        if unknown:
            raise ValueError(
                f"`callback_on_step_end_tensor_inputs` has {unknown}; allowed: {self._callback_tensor_inputs}."
            )

    def check_components(self) -> None:
        """Raise `ValueError` naming every required component that is ``None`` (a pipeline built with ``vqvae=None``
        or ``decoder=None``), and a pipeline whose weights are on the ``meta`` device (nothing to compute with)."""
        missing = [name for name in self.components if name not in self._optional_components and getattr(self, name, None) is None]
        if missing:
            raise ValueError(f"This {type(self).__name__} has no {', '.join(f'`{m}`' for m in missing)}: a call needs every "
                             f"component but {self._optional_components} (set it, e.g. `pipe.decoder = JacobiDecoder()`).")
        if self.draft_heads is not None:
            self.draft_heads.check_modules()  # heads edited after they were attached
            self._check_heads_fit(self.draft_heads)  # or a backbone component swapped under them
        if self.device.type == "meta":
            raise ValueError(f"This {type(self).__name__} is on the meta device (its weights hold no values): load it "
                             "with real weights, or move it to `cpu` or `cuda`.")

    def check_prompt_length(self, prompt_length: int) -> None:
        """Raise `ValueError` naming ``prompt`` when ``prompt_length`` positions (the longest prompt with its template)
        and the image's positions exceed the model's context (`SpatialBackbone.max_sequence_length`): checked after
        tokenizing, before the prompt pass."""
        backbone = self.backbone
        limit, layout = backbone.max_sequence_length, backbone.layout
        if limit is None:
            return
        image = layout.sequence_length
        if prompt_length + image > limit:
            raise ValueError(f"`prompt` takes {prompt_length} positions (with its template) and the image {image}: more "
                             f"than the {limit} this {type(self).__name__} model was trained for. Shorten the prompt to at "
                             f"most {max(limit - image, 0)} positions (its template included).")

    def check_memory(self, batch_size: int, do_cfg: bool, name: str = "num_images_per_prompt") -> None:
        """Raise `ValueError` naming ``name`` when the largest buffers of a call of ``batch_size`` images (the KV cache
        of every row, the decoder's per-row window and one round's logits) would not fit in the device's free memory,
        before anything is allocated (`memory_estimate`)."""
        free = available_memory(self._execution_device)
        if free is None:
            return
        need = self.memory_estimate(batch_size, do_cfg)
        if need > 0.9 * free:
            raise ValueError(
                f"A call of {batch_size} images needs about {need / 2**30:.1f} GiB ({type(self.decoder).__name__}, "
                f"{'with' if do_cfg else 'without'} CFG rows) and {self._execution_device} has {free / 2**30:.1f} GiB "
                f"free: lower `{name}` or the number of prompts, or generate in several calls."
            )

    def memory_estimate(self, batch_size: int, do_cfg: bool) -> int:
        """Bytes a call of ``batch_size`` images allocates for its largest buffers: the KV cache (every row, the grid
        and the widest round), one round's fp32 logits and probabilities, and the decoder's own per-row state
        (`SpatialDecoderMixin.state_bytes`). The prompt's own activations are not counted."""
        backbone, layout = self.backbone, self.backbone.layout
        rows = batch_size * (2 if do_cfg else 1)
        fed = self.decoder.max_fed_tokens(layout) * (2 if layout.has_eol else 1)
        probe = backbone.make_cache(1, 1)  # one slot of one row: the bytes of a slot of every layer
        slot = probe.storage.numel() * probe.storage.element_size()
        slots = 256 + layout.sequence_length + fed  # the prompt, the grid, the widest round
        vocab = backbone.num_image_codes
        return rows * slots * slot + 3 * rows * fed * vocab * 4 + self.decoder.state_bytes(batch_size, vocab)

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
            negatives = _as_list(negative_prompt) * (len(prompts) if len(_as_list(negative_prompt)) == 1 else 1)
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

def available_memory(device: torch.device) -> Optional[int]:
    """Free bytes on ``device``: CUDA's free memory, or the host's available memory for ``cpu`` (Linux
    ``MemAvailable``, else ``os.sysconf``); ``None`` where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_optional_bool(name: str, value, none_means: str) -> Optional[bool]:
    """A loop setting that is True, False or None (``none_means``); anything else is a `ValueError` naming it."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True, False or None ({none_means}), got {value!r}.")
    return value


def _check_generator(generator, num_prompts: int, num_images_per_prompt: int) -> None:
    """``generator``: ``None``, one `torch.Generator`, or one per image (``num_prompts * num_images_per_prompt``)."""
    batch_size = num_prompts * num_images_per_prompt
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch_size:
            raise ValueError(
                f"`generator` is a list of {len(generator)} generators, but the batch has {batch_size} images "
                f"({num_prompts} prompts x num_images_per_prompt={num_images_per_prompt}); pass one per image or a single one."
            )
        if not all(isinstance(g, torch.Generator) for g in generator):
            raise ValueError("`generator` list must hold only `torch.Generator` objects.")
    elif generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"`generator` must be a torch.Generator, a list of them, or None; got {type(generator).__name__}.")


def _check_text(prompts: Sequence[Any], name: str, max_characters: Optional[int] = None) -> None:
    """Raise `ValueError` naming ``name`` for a text prompt that is not valid Unicode (a lone surrogate, which no
    tokenizer can encode), or that is longer than ``max_characters`` (`SpatialBackbone.max_prompt_characters`: it cannot
    fit the model's context, and tokenizing it would cost time for nothing)."""
    for i, p in enumerate(prompts):
        if isinstance(p, str) and max_characters is not None and len(p) > max_characters:
            raise ValueError(f"`{name}` [{i}] holds {len(p)} characters; this model reads at most {max_characters} "
                             "(its context, less the image's positions): shorten the prompt.")
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"`{name}` [{i}] is not valid text: {err.reason} at character {err.start} "
                                 f"({p[err.start:err.end]!r}); decode it with errors='replace' first.") from None


def _check_callback_signature(callback) -> None:
    """Raise `ValueError` unless ``callback`` takes diffusers' ``(pipe, step_index, timestep, callback_kwargs)``."""
    try:
        inspect.signature(callback).bind(None, 0, 0, {})
    except TypeError as err:
        raise ValueError(f"`callback_on_step_end` must take (pipe, step_index, timestep, callback_kwargs) as diffusers "
                         f"callbacks do; {callback!r} does not ({err}).") from None
    except ValueError:  # a builtin without a signature: let the call tell
        pass


def _as_list(prompt, name: str = "prompt") -> List[Any]:
    if isinstance(prompt, (str, int)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 0):
        return [prompt]
    if prompt is None or isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"`{name}` must be a prompt (a string, or a class label for class-conditional models) or a "
                         f"list of them, got {prompt!r}.")
    if isinstance(prompt, collections.abc.Set):  # a set, frozenset or dict view: its order follows the hash seed
        raise ValueError(f"`{name}` must be a list of prompts, got a {type(prompt).__name__}: its order (and so which "
                         "image is which) would depend on the hash seed. Pass a list.")
    return list(prompt)
