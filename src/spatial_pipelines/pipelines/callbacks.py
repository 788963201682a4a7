"""What diffusers pipelines show callbacks and users during a call, for an AR loop (`CallbackStateMixin`):
``guidance_scale``, ``do_classifier_free_guidance``, ``num_timesteps``, ``interrupt`` and the
``callback_on_step_end`` contract itself."""

import dataclasses
from typing import Sequence

import torch

from .device_loop import RoundView
from ..utils import check_number

#: State tensors a callback may ask for: ``latents`` is diffusers' name for the code grid so far (``tokens``).
CALLBACK_TENSOR_INPUTS = ["tokens", "latents", "acceptance_map"]


class CallbackStateMixin:
    """The per-call attributes of a diffusers pipeline, kept by `SpatialARPipeline.__call__`, and the
    ``callback_on_step_end`` contract.

    ``callback_on_step_end(pipe, step_index, num_committed, callback_kwargs)`` is called after every target pass
    (``step_index`` from 0, as diffusers' ``i``) with copies of the state tensors named in
    ``callback_on_step_end_tensor_inputs`` (``tokens``, or diffusers' ``latents``: the ``(B, H, W)`` grid, ``-1`` where
    not yet decoded; ``acceptance_map``); it may return some of them (`_run_callback`), read ``pipe.guidance_scale``,
    ``pipe.do_classifier_free_guidance`` and ``pipe.num_timesteps``, and set ``pipe._guidance_scale`` or
    ``pipe._interrupt``. While a callback is set, the host reads the device after every round, not once per sync.
    """

    _callback_tensor_inputs = CALLBACK_TENSOR_INPUTS
    _guidance_scale = None
    _do_cfg = False
    _num_timesteps = 0
    _interrupt = False

    @property
    def guidance_scale(self) -> float:
        """The CFG scale of the current (or last) call; a callback's ``pipe._guidance_scale`` is used next round."""
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        """Whether the current call runs unconditional rows (``guidance_scale != 1`` when it started)."""
        return self._guidance_scale is not None and self._do_cfg

    @property
    def num_timesteps(self) -> int:
        """Rounds of the current call known so far: those run, plus one while the grid is not full (a callback's last
        step is ``step_index == num_timesteps - 1``); after a call, the rounds it ran."""
        return self._num_timesteps

    @property
    def interrupt(self) -> bool:
        """A callback sets ``pipe._interrupt = True`` to stop the call after its round (undecoded codes stay ``-1``)."""
        return self._interrupt

    def _start_call(self, guidance_scale: float, do_cfg: bool) -> None:
        self._guidance_scale, self._do_cfg, self._num_timesteps, self._interrupt = guidance_scale, do_cfg, 0, False

    def _follow_guidance(self, state: RoundView) -> None:
        """After a callback: a new ``pipe._guidance_scale`` mixes the next rounds. A call without CFG cannot turn it on
        (its rows are fixed when it starts); with CFG, any finite scale >= 0 goes."""
        scale = self._guidance_scale
        if scale == state.sampling.guidance_scale:
            return
        check_number("guidance_scale", scale, 0, meaning="set by callback_on_step_end through `pipe._guidance_scale`")
        if not state.sampling.do_cfg:
            raise ValueError(f"`guidance_scale` was set to {scale} by `callback_on_step_end`, but this call started with "
                             "guidance_scale=1 (no unconditional rows): pass a guidance_scale other than 1 to the call to "
                             "change it during generation.")
        state.sampling = dataclasses.replace(state.sampling, guidance_scale=float(scale), cfg=True)

    def _run_callback(self, callback, tensor_inputs: Sequence[str], step_index: int, state: RoundView) -> None:
        """diffusers' ``callback_on_step_end`` contract: the callback gets copies of the state tensors it names and may
        return a dict of some of them. A returned ``acceptance_map`` replaces the record; a returned ``tokens`` (or
        ``latents``) that changes codes before the last round is a `ValueError` (the KV cache holds them); after the
        last round it replaces the output."""
        layout = state.layout
        grid = layout.grid(state.tokens)
        tensors = {"tokens": grid, "latents": grid}
        if "acceptance_map" in tensor_inputs:  # built only when asked for: a round with a callback runs few ops around it
            tensors["acceptance_map"] = layout.grid(state.acceptance_map)
        outputs = callback(self, step_index, state.num_committed, {k: tensors[k].clone() for k in tensor_inputs})
        self._follow_guidance(state)
        if outputs is None:
            return
        if not isinstance(outputs, dict):
            raise ValueError(f"`callback_on_step_end` must return a dict (or None), got {type(outputs).__name__}.")
        unknown = [k for k in outputs if k not in tensor_inputs]
        if unknown:
            raise ValueError(f"`callback_on_step_end` returned {unknown}, which it was not given; it was given {list(tensor_inputs)}.")
        for name, value in outputs.items():
            current = tensors[name]
            if not isinstance(value, torch.Tensor) or value.shape != current.shape:
                raise ValueError(f"`callback_on_step_end` returned `{name}` of shape "
                                 f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}; expected {tuple(current.shape)}.")
            if value.device != current.device or value.dtype != current.dtype:
                value = value.to(current.device, current.dtype)
            if name in ("tokens", "latents") and not torch.equal(value, current):
                if not state.finished:
                    raise ValueError(f"`callback_on_step_end` returned `{name}` with changed codes before the last round; "
                                     "committed codes cannot be changed during generation (the KV cache holds them) and "
                                     "undecoded ones are -1. Change the grid after the last round "
                                     "(`step_index == pipe.num_timesteps - 1`) or after the call.")
                vocab = self.backbone.num_image_codes
                if value.min() < 0 or value.max() >= vocab:
                    raise ValueError(f"`callback_on_step_end` returned `{name}` with codes outside [0, {vocab}).")
                state.tokens.copy_(value.flatten(1))  # (B, H*W): the grid the call returns
                tensors = {**tensors, "tokens": value, "latents": value}
            if name == "acceptance_map":
                state.acceptance_map.copy_(value.flatten(1))
