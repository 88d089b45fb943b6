"""A guard that rejects host tensors mixed with device tensors, for the device-discipline tests.

Run a path with its device tensors on `meta` inside `DeviceGuard("meta")`: `meta` tensors already
refuse every host sync (`.item()`, `.tolist()`, `.cpu()`, truthiness) and most elementwise mixes;
the guard also fails an op that takes a host tensor beside a guarded-device tensor (indexing with a
CPU index, `index_copy` of CPU values), which `meta` lets through and CUDA turns into a hidden copy.
0-dim host tensors are allowed: torch passes them to device kernels as scalars, with no copy.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class HostMixError(AssertionError):
    pass


class DeviceGuard(TorchFunctionMode):
    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type == self.device.type for t in tensors)
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if on_device and host:
            raise HostMixError(f"{getattr(func, '__name__', func)} mixes a host tensor of shape "
                               f"{tuple(host[0].shape)} with {self.device.type} tensors")
        return func(*args, **kwargs)
