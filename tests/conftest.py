import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: one torch thread per worker, so workers do not oversubscribe the cores
    import torch

    torch.set_num_threads(1)
