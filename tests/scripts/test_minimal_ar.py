"""scripts/minimal_ar.py, the benchmark's independent AR baseline, draws the pipeline's own codes, so its timing row
compares like with like: seeded samples in fp32, and greedy codes in bf16 too (its RoPE runs in fp32, as the
model's). bf16 samples are not compared: the two loops' bf16 ops need not round alike, and a random
tiny model's top-k logits are close enough for that to change a draw."""

import pytest
import torch

from spatial_pipelines.testing import dummy_pipeline

from helpers import load_script

minimal_ar_generate = load_script("minimal_ar.py").minimal_ar_generate


@pytest.mark.parametrize("dtype, top_k", [(torch.float32, 1), (torch.float32, 3), (torch.float32, 0), (torch.bfloat16, 1)])
def test_minimal_ar_loop_reproduces_the_pipeline(dtype, top_k):
    """The pipeline's codes, from the same seeds."""
    pipe = dummy_pipeline("llamagen", decoder="ar").to(dtype=dtype)
    prompts = ["a red heart", "pizza"]
    ref = pipe(prompts, guidance_scale=1.5, top_k=top_k, output_type="latent",
               generator=[torch.Generator().manual_seed(s) for s in (0, 1)]).tokens
    got = minimal_ar_generate(pipe, prompts, 1.5, 1.0, top_k, [torch.Generator().manual_seed(s) for s in (0, 1)])
    assert torch.equal(got.reshape(ref.shape).to(ref.device), ref)


def test_compiled_minimal_ar_loop_reproduces_the_pipeline():
    """``compile=True`` (the decode step as one compiled function over buffers kept across calls; the ``eager``
    backend here: dynamo's trace and the buffer reuse, not inductor's kernels) draws the same codes, twice."""
    pipe = dummy_pipeline("llamagen", decoder="ar")
    prompts = ["a red heart", "pizza"]
    ref = pipe(prompts, guidance_scale=1.5, top_k=3, output_type="latent",
               generator=[torch.Generator().manual_seed(s) for s in (0, 1)]).tokens
    for _ in range(2):  # the second call reuses the first one's cache buffers
        got = minimal_ar_generate(pipe, prompts, 1.5, 1.0, 3, [torch.Generator().manual_seed(s) for s in (0, 1)],
                                  compile=True, compile_backend="eager")
        assert torch.equal(got.reshape(ref.shape), ref)
