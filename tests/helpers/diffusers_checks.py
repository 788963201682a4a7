"""diffusers' generic pipeline checks (``PipelineTesterMixin`` of diffusers' ``tests/pipelines/test_pipelines_common.py``,
main branch), written again for our pipelines: the same inputs and the same assertions, one method per check, under the
same name. `PipelineTesterMixin` (``pipeline_tester.py``) includes them, so every family runs them.

The adaptations, and only these (each is marked where it happens):

- **safetensors**: where diffusers saves with ``safe_serialization=False``, the save is a safetensors save (our pipelines
  refuse to write pickles, docs/heads.md).
- **no ``num_inference_steps``** is copied into batched inputs (a pipeline of ours has no steps to set).
- **float16 and ``to`` on the CPU**: diffusers runs ``test_float16_inference``, ``test_save_load_float16`` and
  ``test_to_device`` on an accelerator only; torch computes float16 on the CPU too, so they run here, with the same
  assertions (``test_to_device`` keeps its CPU half).
- **layerwise casting on a transformers target**: a target without diffusers' ``enable_layerwise_casting`` gets the
  hook it installs (``diffusers.hooks.apply_layerwise_casting``).

- **offloading on the CPU**: ``test_model_cpu_offload_forward_pass``, ``test_cpu_offload_forward_pass_twice`` and
  ``test_pipeline_level_group_offloading_inference`` run with the CPU as the device the models are moved to (diffusers
  uses an accelerator): the hooks are installed and run, and the output must not change.

Of the 33 test methods of diffusers' ``PipelineTesterMixin`` (at diffusers commit ``58eb52c``), 25 have their port
here. The other 8 are not ported (a test that could only skip or return would pass while checking nothing):

- ``test_attention_slicing_forward_pass``, ``test_xformers_attention_forwardGenerator_pass``: the backbones attend with
  one fused SDPA call over a KV cache, without attention processors to slice or swap (diffusers sets
  ``test_attention_slicing = False`` for such pipelines).
- ``test_sequential_cpu_offload_forward_pass``, ``test_sequential_offload_forward_pass_twice``: sequential offload
  leaves the weights on the meta device between uses, and the pipelines refuse a model on the meta device (a
  `ValueError` naming it); model CPU offload and group offloading are what they support.
- ``test_group_offloading_inference``, ``test_pipeline_level_group_offloading_sanity_checks``: the first offloads the
  diffusers models among the components one by one (``test_pipeline_level_group_offloading_inference`` offloads them
  all, transformers models too); the second checks on which device each component is left, which with the CPU as
  both onload and offload device cannot fail.
- ``test_StableDiffusionMixin_component``, ``test_encode_prompt_works_in_isolation``: they apply to Stable Diffusion
  pipelines and to pipelines with their own ``encode_prompt``; no pipeline here is either
  (``tests/test_coverage.py`` checks it, so a pipeline that becomes one fails until its check is ported).
"""

import inspect
import json
import logging
import os
import tempfile

import numpy as np
import pytest
import torch
from diffusers.utils import logging as diffusers_logging

#: diffusers' ``TEXT_TO_IMAGE_PARAMS`` less what a token model has no use for: ``height``/``width`` (the grid is the
#: checkpoint's), ``prompt_embeds``/``negative_prompt_embeds`` and ``cross_attention_kwargs`` (no embedding inputs, no
#: attention processors). diffusers' own test classes subtract what a pipeline lacks the same way.
TEXT_TO_IMAGE_PARAMS = frozenset(["prompt", "guidance_scale", "negative_prompt"])
TEXT_TO_IMAGE_BATCH_PARAMS = frozenset(["prompt", "negative_prompt"])
#: diffusers' ``required_optional_params`` less ``num_inference_steps`` and ``latents``: a speculative decoder runs
#: until the grid is full (no step count), and the grid is sampled code by code (no initial noise to pass in).
REQUIRED_OPTIONAL_PARAMS = frozenset(["num_images_per_prompt", "generator", "output_type", "return_dict"])



def to_np(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


class DiffusersPipelineChecks:
    """Needs ``pipeline_class``, ``prompts`` and ``get_pipeline()`` from the family tester."""

    params = TEXT_TO_IMAGE_PARAMS
    batch_params = TEXT_TO_IMAGE_BATCH_PARAMS
    required_optional_params = REQUIRED_OPTIONAL_PARAMS

    def get_dummy_components(self):
        return dict(self.get_pipeline().components)

    def get_generator(self, seed):
        return torch.Generator("cpu").manual_seed(seed)

    def get_dummy_inputs(self, device="cpu", seed=0):
        return {"prompt": self.prompts[0], "generator": self.get_generator(seed), "output_type": "np"}

    def _pipe(self, components=None):
        pipe = self.pipeline_class(**(components if components is not None else self.get_dummy_components()))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _batched(self, inputs, batch_size):
        """diffusers' batching of ``batch_params``: prompts of unequal lengths, the last one very long."""
        batched = dict(inputs)
        for name in self.batch_params:
            if name not in inputs:
                continue
            value = inputs[name]
            if name == "prompt" and isinstance(value, str):
                batched[name] = [value[: len(value) // i] for i in range(1, batch_size + 1)]
                batched[name][-1] = 100 * "very long"
            else:
                batched[name] = batch_size * [value]
        if "generator" in inputs:
            batched["generator"] = [self.get_generator(i) for i in range(batch_size)]
        return batched  # adaptation: no `num_inference_steps` to copy

    # -- the checks, in diffusers' order ---------------------------------------------------------------------------
    def test_save_load_local(self, expected_max_difference=5e-4):
        pipe = self._pipe()
        output = pipe(**self.get_dummy_inputs())[0]
        logger = diffusers_logging.get_logger("diffusers.pipelines.pipeline_utils")
        level = logger.level
        logger.setLevel(diffusers_logging.INFO)
        records = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        logger.addHandler(handler)
        try:
            with tempfile.TemporaryDirectory() as tmpdir:
                pipe.save_pretrained(tmpdir)  # adaptation: safetensors, where diffusers asks for a pickle
                loaded = self.pipeline_class.from_pretrained(tmpdir)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        log = "\n".join(records)
        for name in loaded.components:
            if name not in loaded._optional_components:
                assert name in log, f"loading did not log `{name}`"
        loaded.set_progress_bar_config(disable=True)
        output_loaded = loaded(**self.get_dummy_inputs())[0]
        assert np.abs(to_np(output) - to_np(output_loaded)).max() < expected_max_difference

    def test_pipeline_call_signature(self):
        assert hasattr(self.pipeline_class, "__call__")
        parameters = inspect.signature(self.pipeline_class.__call__).parameters
        optional = {k for k, v in parameters.items() if v.default is not inspect.Parameter.empty}
        names = set(parameters) - {"self", "kwargs"}
        assert not (set(self.params) - names), f"Required parameters not present: {set(self.params) - names}"
        missing = set(self.required_optional_params) - optional
        assert not missing, f"Required optional parameters not present: {missing}"

    def test_inference_batch_consistent(self, batch_sizes=(2,)):
        pipe = self._pipe()
        inputs = self.get_dummy_inputs()
        inputs["generator"] = self.get_generator(0)
        for batch_size in batch_sizes:
            output = pipe(**self._batched(inputs, batch_size))
            assert len(output[0]) == batch_size

    def test_inference_batch_single_identical(self, batch_size=3, expected_max_diff=1e-4):
        pipe = self._pipe()
        inputs = self.get_dummy_inputs()
        inputs["generator"] = self.get_generator(0)
        batched = self._batched(inputs, batch_size)
        output = pipe(**inputs)
        output_batch = pipe(**batched)
        assert output_batch[0].shape[0] == batch_size
        assert np.abs(to_np(output_batch[0][0]) - to_np(output[0][0])).max() < expected_max_diff

    def test_dict_tuple_outputs_equivalent(self, expected_max_difference=1e-4):
        pipe = self._pipe()
        output = pipe(**self.get_dummy_inputs("cpu"))[0]
        output_tuple = pipe(**self.get_dummy_inputs("cpu"), return_dict=False)[0]
        assert np.abs(to_np(output) - to_np(output_tuple)).max() < expected_max_difference

    def test_components_function(self):
        init = {k: v for k, v in self.get_dummy_components().items() if not isinstance(v, (str, int, float))}
        pipe = self.pipeline_class(**init)
        assert hasattr(pipe, "components")
        assert set(pipe.components) == set(init)

    def test_float16_inference(self, expected_max_diff=5e-2):
        pipe = self._pipe()
        pipe_fp16 = self._pipe()
        pipe_fp16.to(dtype=torch.float16)  # adaptation: on the CPU
        modules = [c for c in pipe_fp16.components.values() if isinstance(c, torch.nn.Module)]
        assert modules and all(m.dtype == torch.float16 for m in modules)
        inputs = self.get_dummy_inputs()
        inputs["generator"] = self.get_generator(0)
        output = pipe(**inputs)[0]
        fp16_inputs = self.get_dummy_inputs()
        fp16_inputs["generator"] = self.get_generator(0)
        output_fp16 = pipe_fp16(**fp16_inputs)[0]
        assert np.isfinite(to_np(output_fp16)).all()
        max_diff = np.abs(to_np(output) - to_np(output_fp16)).max()
        assert max_diff < expected_max_diff, "The outputs of the fp16 and fp32 pipelines are too different."

    def test_save_load_float16(self, expected_max_diff=1e-2):
        components = self.get_dummy_components()
        for name, module in components.items():
            if hasattr(module, "half"):
                components[name] = module.half()  # adaptation: on the CPU
        pipe = self._pipe(components)
        output = pipe(**self.get_dummy_inputs())[0]
        with tempfile.TemporaryDirectory() as tmpdir:
            pipe.save_pretrained(tmpdir)  # adaptation: safetensors, where diffusers asks for a pickle
            loaded = self.pipeline_class.from_pretrained(tmpdir, dtype=torch.float16)
            loaded.set_progress_bar_config(disable=True)
        dtypes = {name: c.dtype for name, c in loaded.components.items() if isinstance(c, torch.nn.Module)}
        assert dtypes and all(d == torch.float16 for d in dtypes.values()), f"not loaded in float16: {dtypes}"
        output_loaded = loaded(**self.get_dummy_inputs())[0]
        max_diff = np.abs(to_np(output) - to_np(output_loaded)).max()
        assert max_diff < expected_max_diff, "The output of the fp16 pipeline changed after saving and loading."

    def test_save_load_optional_components(self, expected_max_difference=1e-4):
        if not getattr(self.pipeline_class, "_optional_components", None):
            pytest.skip(f"{self.pipeline_class.__name__} has no optional components to leave out")
        pipe = self._pipe()
        for name in pipe._optional_components:
            setattr(pipe, name, None)
        torch.manual_seed(0)
        output = pipe(**self.get_dummy_inputs("cpu"))[0]
        with tempfile.TemporaryDirectory() as tmpdir:
            pipe.save_pretrained(tmpdir)  # adaptation: safetensors, where diffusers asks for a pickle
            loaded = self.pipeline_class.from_pretrained(tmpdir)
            loaded.set_progress_bar_config(disable=True)
        for name in pipe._optional_components:
            assert getattr(loaded, name) is None, f"`{name}` did not stay set to None after loading."
        torch.manual_seed(0)
        output_loaded = loaded(**self.get_dummy_inputs("cpu"))[0]
        assert np.abs(to_np(output) - to_np(output_loaded)).max() < expected_max_difference

    def test_to_device(self):
        components = self.get_dummy_components()
        pipe = self._pipe(components)
        pipe.to("cpu")  # adaptation: the CPU half of diffusers' check (its other half moves to an accelerator)
        devices = [c.device.type for c in components.values() if hasattr(c, "device")]
        assert devices and all(d == "cpu" for d in devices)
        output_cpu = pipe(**self.get_dummy_inputs("cpu"))[0]
        assert np.isnan(to_np(output_cpu)).sum() == 0

    def test_to_dtype(self):
        components = self.get_dummy_components()
        pipe = self.pipeline_class(**components)
        dtypes = [c.dtype for c in components.values() if getattr(c, "dtype", None)]
        assert all(d == torch.float32 for d in dtypes)
        pipe.to(dtype=torch.float16)
        dtypes = [c.dtype for c in components.values() if getattr(c, "dtype", None)]
        assert all(d == torch.float16 for d in dtypes)

    def _check_cpu_offload_hooks(self, pipe):
        import accelerate

        offloaded = {k: v for k, v in pipe.components.items()
                     if isinstance(v, torch.nn.Module) and k not in pipe._exclude_from_cpu_offload}
        assert offloaded, "no component to offload"
        assert all(v.device.type == "cpu" for v in offloaded.values()), f"Not offloaded: {[k for k, v in offloaded.items() if v.device.type != 'cpu']}"
        assert all(hasattr(v, "_hf_hook") for v in offloaded.values()), f"No hook attached: {[k for k, v in offloaded.items() if not hasattr(v, '_hf_hook')]}"
        wrong = {k: type(v._hf_hook) for k, v in offloaded.items() if not isinstance(v._hf_hook, accelerate.hooks.CpuOffload)}
        assert not wrong, f"Not installed correct hook: {wrong}"

    def test_model_cpu_offload_forward_pass(self, expected_max_diff=2e-4):
        pipe = self._pipe()
        output_without_offload = pipe(**self.get_dummy_inputs())[0]
        pipe.enable_model_cpu_offload(device="cpu")  # adaptation: the CPU is the device the models are moved to
        assert pipe._execution_device.type == "cpu"
        output_with_offload = pipe(**self.get_dummy_inputs())[0]
        max_diff = np.abs(to_np(output_with_offload) - to_np(output_without_offload)).max()
        assert max_diff < expected_max_diff, "CPU offloading should not affect the inference results"
        self._check_cpu_offload_hooks(pipe)

    def test_cpu_offload_forward_pass_twice(self, expected_max_diff=2e-4):
        pipe = self._pipe()
        pipe.enable_model_cpu_offload(device="cpu")  # adaptation: the CPU is the device the models are moved to
        output_with_offload = pipe(**self.get_dummy_inputs())[0]
        pipe.enable_model_cpu_offload(device="cpu")
        output_with_offload_twice = pipe(**self.get_dummy_inputs())[0]
        max_diff = np.abs(to_np(output_with_offload) - to_np(output_with_offload_twice)).max()
        assert max_diff < expected_max_diff, "running CPU offloading 2nd time should not affect the inference results"
        self._check_cpu_offload_hooks(pipe)

    def test_num_images_per_prompt(self):
        pipe = self._pipe()
        for batch_size in (1, 2):
            for num_images_per_prompt in (1, 2):
                inputs = self.get_dummy_inputs()
                for key in list(inputs):
                    if key in self.batch_params:
                        inputs[key] = batch_size * [inputs[key]]
                images = pipe(**inputs, num_images_per_prompt=num_images_per_prompt)[0]
                assert images.shape[0] == batch_size * num_images_per_prompt

    def test_cfg(self):
        pipe = self._pipe()
        inputs = self.get_dummy_inputs()
        inputs["guidance_scale"] = 1.0
        out_no_cfg = pipe(**inputs)[0]
        inputs = self.get_dummy_inputs()
        inputs["guidance_scale"] = 7.5
        out_cfg = pipe(**inputs)[0]
        assert out_cfg.shape == out_no_cfg.shape

    def test_callback_inputs(self):
        pipe = self._pipe()
        assert hasattr(pipe, "_callback_tensor_inputs")

        def callback_inputs_subset(pipe, i, t, callback_kwargs):
            for name in callback_kwargs:
                assert name in pipe._callback_tensor_inputs
            return callback_kwargs

        def callback_inputs_all(pipe, i, t, callback_kwargs):
            for name in pipe._callback_tensor_inputs:
                assert name in callback_kwargs
            for name in callback_kwargs:
                assert name in pipe._callback_tensor_inputs
            return callback_kwargs

        inputs = self.get_dummy_inputs()
        inputs["callback_on_step_end"] = callback_inputs_subset
        inputs["callback_on_step_end_tensor_inputs"] = ["latents"]
        inputs["output_type"] = "latent"
        pipe(**inputs)
        inputs["callback_on_step_end"] = callback_inputs_all
        inputs["callback_on_step_end_tensor_inputs"] = pipe._callback_tensor_inputs
        pipe(**inputs)

        def callback_inputs_change_tensor(pipe, i, t, callback_kwargs):
            if i == pipe.num_timesteps - 1:
                callback_kwargs["latents"] = torch.zeros_like(callback_kwargs["latents"])
            return callback_kwargs

        inputs["callback_on_step_end"] = callback_inputs_change_tensor
        inputs["callback_on_step_end_tensor_inputs"] = pipe._callback_tensor_inputs
        output = pipe(**inputs)[0]
        assert output.abs().sum() == 0

    def test_callback_cfg(self):
        pipe = self._pipe()
        assert hasattr(pipe, "_callback_tensor_inputs")

        def callback_increase_guidance(pipe, i, t, callback_kwargs):
            pipe._guidance_scale += 1.0
            return callback_kwargs

        inputs = self.get_dummy_inputs()
        inputs["guidance_scale"] = 2.0
        inputs["callback_on_step_end"] = callback_increase_guidance
        inputs["callback_on_step_end_tensor_inputs"] = pipe._callback_tensor_inputs
        pipe(**inputs)
        assert pipe.guidance_scale == inputs["guidance_scale"] + pipe.num_timesteps

    def test_serialization_with_variants(self):
        pipe = self._pipe()
        model_components = [n for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)]
        variant = "fp16"
        assert model_components, "the pipeline has no model components to save with a variant"
        checked = []
        with tempfile.TemporaryDirectory() as tmpdir:
            pipe.save_pretrained(tmpdir, variant=variant)  # adaptation: safetensors, where diffusers asks for a pickle
            with open(os.path.join(tmpdir, "model_index.json")) as f:
                config = json.load(f)
            for subfolder in os.listdir(tmpdir):
                if not os.path.isfile(subfolder) and subfolder in model_components:
                    folder = os.path.join(tmpdir, subfolder)
                    assert os.path.isdir(folder) and subfolder in config
                    assert any(p.split(".")[1].startswith(variant) for p in os.listdir(folder)), os.listdir(folder)
                    checked.append(subfolder)
        assert sorted(checked) == sorted(model_components), f"model components without a folder: {model_components}"

    def test_loading_with_variants(self):
        pipe = self._pipe()
        variant = "fp16"
        with tempfile.TemporaryDirectory() as tmpdir:
            pipe.save_pretrained(tmpdir, variant=variant)  # adaptation: safetensors, where diffusers asks for a pickle
            loaded = self.pipeline_class.from_pretrained(tmpdir, variant=variant)
            modules = {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
            loaded_modules = {n: c for n, c in loaded.components.items() if isinstance(c, torch.nn.Module)}
            assert modules and set(loaded_modules) == set(modules), (sorted(modules), sorted(loaded_modules))
            compared = 0
            for name, module in modules.items():
                loaded_params = dict(loaded_modules[name].named_parameters())
                for param_name, p1 in module.named_parameters():
                    if param_name not in loaded_params:  # tied weights are not saved twice (diffusers skips them too)
                        continue
                    p2 = loaded_params[param_name]
                    if not (torch.isnan(p1).any() and torch.isnan(p2).any()):
                        assert torch.equal(p1, p2), f"{name}.{param_name}"
                        compared += 1
            assert compared, "no parameter was compared"

    def test_loading_with_incorrect_variants_raises_error(self):
        pipe = self._pipe()
        variant = "fp16"
        with tempfile.TemporaryDirectory() as tmpdir:
            pipe.save_pretrained(tmpdir)  # no variant; adaptation: safetensors, where diffusers asks for a pickle
            with pytest.raises(ValueError) as error:
                self.pipeline_class.from_pretrained(tmpdir, variant=variant)
            assert f"You are trying to load the model files of the `variant={variant}`" in str(error.value)

    def test_layerwise_casting_inference(self):
        from diffusers.hooks import apply_layerwise_casting

        pipe = self._pipe()
        pipe.to("cpu", dtype=torch.bfloat16)
        if hasattr(pipe.transformer, "enable_layerwise_casting"):
            target = pipe.transformer
            target.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        else:  # adaptation: a transformers target gets the hook diffusers' method installs
            target = pipe.backbone.target_module
            apply_layerwise_casting(target, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        assert any(p.dtype == torch.float8_e4m3fn for p in target.parameters()), "no weight is stored in float8"
        output = pipe(**self.get_dummy_inputs())
        assert np.isfinite(to_np(output.images)).all()
        assert (output.tokens >= 0).all() and (output.tokens < pipe.backbone.num_image_codes).all()

    def test_dtype_dict(self):
        components = self.get_dummy_components()
        pipe = self.pipeline_class(**components)
        specified_key = next(iter(components.keys()))
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmpdir:
            pipe.save_pretrained(tmpdir)  # adaptation: safetensors, where diffusers asks for a pickle
            dtype_dict = {specified_key: torch.bfloat16, "default": torch.float16}
            loaded = self.pipeline_class.from_pretrained(tmpdir, dtype=dtype_dict)
        modules = {n: c for n, c in loaded.components.items() if isinstance(c, torch.nn.Module) and hasattr(c, "dtype")}
        assert specified_key in modules, f"the first component, {specified_key!r}, is not a model with a dtype"
        for name, component in modules.items():
            expected = dtype_dict.get(name, dtype_dict.get("default", torch.float32))
            assert component.dtype == expected, f"Component '{name}' has dtype {component.dtype} but expected {expected}"

    def test_dtype_alias(self):
        pipe = self._pipe()
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmpdir:
            pipe.save_pretrained(tmpdir)  # adaptation: safetensors, where diffusers asks for a pickle
            loaded = self.pipeline_class.from_pretrained(tmpdir, dtype=torch.float16)
        modules = {n: c for n, c in loaded.components.items() if isinstance(c, torch.nn.Module) and hasattr(c, "dtype")}
        assert modules, "no component with a dtype was loaded"
        for name, component in modules.items():
            assert component.dtype == torch.float16, f"Component '{name}' has dtype {component.dtype}"

    def test_pipeline_level_group_offloading_inference(self, expected_max_difference=1e-4):
        pipe = self._pipe()
        output = pipe(**self.get_dummy_inputs())[0]
        pipe.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                                  offload_type="leaf_level")  # adaptation: the CPU is the onload device
        modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
        hooked = [any(hasattr(sub, "_diffusers_hook") for sub in m.modules()) for m in modules]
        assert modules and all(hooked), "a model component has no group offloading hook"
        output_offloaded = pipe(**self.get_dummy_inputs())[0]
        max_diff = np.abs(to_np(output) - to_np(output_offloaded)).max()
        assert max_diff < expected_max_difference, "group offloading should not affect the inference results"

    def test_pipeline_with_accelerator_device_map(self, expected_max_difference=1e-4):
        pipe = self._pipe()
        inputs = self.get_dummy_inputs()
        inputs["generator"] = torch.manual_seed(0)
        out = pipe(**inputs)[0]
        with tempfile.TemporaryDirectory() as tmpdir:
            pipe.save_pretrained(tmpdir)
            loaded = self.pipeline_class.from_pretrained(tmpdir, device_map="cpu")  # diffusers' torch_device: this suite's
            loaded.set_progress_bar_config(disable=True)
        inputs["generator"] = torch.manual_seed(0)
        loaded_out = loaded(**inputs)[0]
        assert np.abs(to_np(out) - to_np(loaded_out)).max() < expected_max_difference
