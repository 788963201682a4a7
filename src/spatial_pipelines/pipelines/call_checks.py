"""The checks a pipeline call runs before any work (`CallChecksMixin`): its arguments, the components, the prompt's
length against the model's context and the memory the batch needs. Each finding is a `ValueError` naming the
argument."""

import collections.abc
import inspect
from typing import Any, List, Optional, Sequence, Union

import torch

from ..core.sampling import SAMPLING_NOISE
from ..utils import available_memory, check_number

#: The largest `guidance_scale` a call takes: beyond it ``uncond + s * (cond - uncond)`` overflows fp32 logits.
MAX_GUIDANCE_SCALE = 1e4

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
PromptInput = Union[str, int, Sequence[Union[str, int]]]


class CallChecksMixin:
    """`SpatialARPipeline`'s checks of a call (`check_inputs`, `check_components`, `check_prompt_length`,
    `check_memory`), on the pipeline's backbone adapter (``self.backbone``), decoder and draft heads."""

    def check_inputs(self, prompt, negative_prompt, guidance_scale, temperature, top_k, top_p, num_images_per_prompt,
                     generator, output_type, callback_on_step_end_tensor_inputs, callback_on_step_end=None,
                     sampling_noise=None) -> List[Any]:
        """Validate the call's arguments; returns the prompt as a list. Raises `ValueError` naming the argument."""
        prompts = as_list(prompt, "prompt")
        if len(prompts) == 0:
            raise ValueError("`prompt` must hold at least one prompt, got an empty list.")
        backbone = self.backbone
        backbone.check_prompt(prompts, "prompt")
        _check_text(prompts, "prompt", backbone.max_prompt_characters)
        if negative_prompt is not None:
            negatives = as_list(negative_prompt, "negative_prompt")
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
                             "tests them otherwise: pass `sampling_noise='drawn'` or None.")
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


def as_list(prompt, name: str = "prompt") -> List[Any]:
    if isinstance(prompt, (str, int)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 0):
        return [prompt]
    if prompt is None or isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"`{name}` must be a prompt (a string, or a class label for class-conditional models) or a "
                         f"list of them, got {prompt!r}.")
    if isinstance(prompt, collections.abc.Set):  # a set, frozenset or dict view: its order follows the hash seed
        raise ValueError(f"`{name}` must be a list of prompts, got a {type(prompt).__name__}: its order (and so which "
                         "image is which) would depend on the hash seed. Pass a list.")
    return list(prompt)
