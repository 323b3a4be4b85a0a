"""Lab 02 solution: bucketed gradient all-reduce overlapped with backward (see exercises/)."""

import torch


def make_buckets(params, bucket_bytes):
    """Reverse order; a new bucket when the next parameter would overflow the current one."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class BucketedAllReduce:
    def __init__(self, params, comm, bucket_bytes):
        self.comm = comm
        self.buckets = make_buckets(params, bucket_bytes)
        self.bucket_index = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)  # gradients complete, per bucket
        self.in_flight = []  # (bucket, flat tensor, handle), in launch order
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param):
        i = self.bucket_index[param]
        self.ready[i] += 1
        # launch every complete bucket, strictly in bucket order (same order on every rank)
        while len(self.in_flight) < len(self.buckets):
            next_bucket = len(self.in_flight)
            bucket = self.buckets[next_bucket]
            if self.ready[next_bucket] < len(bucket):
                return
            flat = torch.cat([p.grad.reshape(-1) for p in bucket]) / self.comm.size
            self.in_flight.append((bucket, flat, self.comm.all_reduce(flat, async_op=True)))

    def wait(self):
        for bucket, flat, handle in self.in_flight:
            handle.wait()
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.in_flight = []
        self.ready = [0] * len(self.buckets)
