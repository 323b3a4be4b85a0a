"""Gradient buckets: the messages DDP and ZeRO send, a few parameters' gradients in each (a
message per tensor pays the latency α per tensor; one for the model waits for all of backward)."""

from __future__ import annotations

import torch


def bucket_params(params: list[torch.Tensor], bucket_mb: float) -> list[list[torch.Tensor]]:
    """DDP's and ZeRO's messages: buckets of at most `bucket_mb` MiB (a larger parameter alone; 0:
    one each; `math.inf`: one), one dtype and device each, in reverse definition order (roughly
    the order backward produces gradients)."""
    buckets = []
    size = 0
    kind = None
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if size + nbytes > bucket_mb * 2**20 or (p.dtype, p.device) != kind:
            kind = (p.dtype, p.device)
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
