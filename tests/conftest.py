"""Shared test setup: single-threaded torch (the machine is shared) and no hub access."""

import os

# Read by `datasets`/`huggingface_hub` at import: every test stays offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
