"""Shared test setup: single-threaded torch (the machine is shared) and tiny-model fixtures."""

import torch

torch.set_num_threads(1)
