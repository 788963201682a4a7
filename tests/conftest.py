import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: one torch thread per worker, so workers do not oversubscribe the cores
    import torch

    torch.set_num_threads(1)

import spatial_pipelines.pipelines.pass_cost  # noqa: E402

# "auto" draft sizes time c(T) and each decoder's round in sweeps; 3 instead of 15 on the tiny test models, whose
# chosen sizes only the cost tests check (tests/decoders/test_round_cost.py, tests/scripts/test_check_auto_sizes.py)
spatial_pipelines.pipelines.pass_cost.SWEEPS = 3
