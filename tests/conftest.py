import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
