"""Sharded training state for checkpoints: made whole, and cut again.

A checkpoint wants every tensor whole, by parameter and in the single-device names, so that
any other layout can read it; the strategies that shard keep only this rank's piece.

**ZeRO-1/2** (hplab/parallel/zero.py) keeps each rank's 1/n of every flat bucket's fp32 master
and optimizer state: `full_state()` all-gathers each bucket's shards and cuts the whole bucket
back into its parameters; `load_full_state()` does the reverse, with no message (every rank is
handed the whole state and keeps its own shards). torch's own `consolidate_state_dict(to)` /
`state_dict()` / `load_state_dict()` sit on top, as ZeroRedundancyOptimizer has them. A mixin of
ZeroOptimizer: it reads the optimizer's buckets, its frozen parameters and its inner optimizer.

**fully_shard** (hplab/parallel/fsdp.py, ZeRO-3) keeps rows [r·rows, (r+1)·rows) of each
parameter, padded: `gather_full` all-gathers a shard (or optimizer state shaped like it) into
the full tensor, `local_shard` cuts a full tensor into this rank's piece, `full_parameters`
gives a module's every parameter whole (torch's `get_model_state_dict` does this for FSDP2).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hplab.parallel import fsdp

UNSAVED = ("params", "shard_over")  # a state_dict's groups hold no communicator


class ShardedState:
    """Checkpoints of a ZeroOptimizer: its shards made whole (a collective), and cut again."""

    @torch.no_grad()
    def full_state(self) -> tuple[dict, dict]:
        """({param: full fp32 value}, {param: {state name: full tensor}}) on the CPU of every
        rank (a collective). 0-dim state (Adam's step) is kept as is."""
        values = {p: p.detach().float().cpu().clone() for p in self.frozen}
        states = {p: {} for p in self.frozen}
        for b in self.buckets:
            values.update(b.gather_full(b.master))
            state = self.inner.state.get(b.master, {})
            full = {k: b.gather_full(t) for k, t in state.items() if torch.is_tensor(t) and t.dim()}
            for p in b.params:
                states[p] = {
                    k: full[k][p] if k in full else (t.cpu().clone() if torch.is_tensor(t) else t)
                    for k, t in state.items()
                }
        return values, states

    @torch.no_grad()
    def load_full_state(self, values: dict, states: dict) -> None:
        """The reverse of `full_state`: every rank gets the full dicts, keeps its shards (and
        the whole params, which every rank holds in stages 1 and 2). No communication."""
        for p in self.frozen:
            if p in values:
                p.copy_(values[p])
        for b in self.buckets:
            flat = b.pack(values, torch.float32)
            b.master.copy_(flat[b.lo : b.hi])
            b.flat.copy_(flat)  # (after the master: it may be a view of the flat buffer)
            saved = next((states[p] for p in b.params if states.get(p)), None)
            if saved is not None:
                self.inner.state[b.master] = {
                    k: b.pack(
                        {p: states[p][k] for p in b.params if k in states.get(p, {})}, t.dtype
                    )[b.lo : b.hi]
                    .clone()
                    .to(b.master.device)
                    if torch.is_tensor(t) and t.dim()
                    else (t.clone() if torch.is_tensor(t) else t)
                    for k, t in saved.items()
                }

    # -- torch's state_dict, as ZeroRedundancyOptimizer has it ---------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state (a collective); rank `to` keeps it for `state_dict()`."""
        _, states = self.full_state()
        params = [p for g in self.param_groups for p in g["params"]]
        index = iter(range(len(params)))
        self.consolidated = (
            None
            if self.comm.rank != to
            else {
                "state": {i: states[p] for i, p in enumerate(params) if states.get(p)},
                "param_groups": [
                    {
                        **{k: v for k, v in g.items() if k not in UNSAVED},
                        "params": [next(index) for _ in g["params"]],
                    }
                    for g in self.param_groups
                ],
            }
        )

    def state_dict(self) -> dict:
        """The whole state in torch's format, on the rank `consolidate_state_dict` named."""
        if getattr(self, "consolidated", None) is None:
            raise RuntimeError(
                "call consolidate_state_dict(to=rank) on every rank first; "
                "state_dict() then returns the whole state on that rank"
            )
        return self.consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (what `state_dict()` returned), given to every rank. The fp32
        masters are re-read from the params (exact in fp32; rounded for bf16/fp16 params)."""
        params = [p for g in self.param_groups for p in g["params"]]
        for g, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k not in UNSAVED})
        states = {params[int(i)]: s for i, s in state_dict["state"].items()}
        self.load_full_state({p: p.detach().float() for p in params}, states)


# --- fully_shard's row shards ------------------------------------------------------------------


@torch.no_grad()
def gather_full(shard_param: nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor (CPU, unpadded) of `tensor`, shaped like the owned shard `shard_param`
    (the shard itself, or optimizer state such as exp_avg). A collective: every rank calls it."""
    if tensor.dim() == 0:  # e.g. Adam's step count: the same on every rank
        return tensor.detach().cpu().clone()
    cut = fsdp.managed(shard_param)
    comm = cut.comm
    send = tensor.detach().to(comm.device).contiguous()
    out = send.new_empty((comm.size * cut.rows, *cut.rest))
    comm.all_gather(out, send)
    return out[: cut.d0].reshape(cut.shape).cpu()


@torch.no_grad()
def local_shard(shard_param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` (a tensor shaped like the unsharded parameter), padded and
    placed like `shard_param`: the inverse of `gather_full`."""
    return fsdp.managed(shard_param).mine(full).to(shard_param.device, copy=True)


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full fp32 tensor on the CPU} for every parameter of `module`, named as in the
    single-device model. A collective: every rank calls it, outside forward/backward."""
    return {
        name: (gather_full(p, p) if fsdp.is_shard(p) else p.detach().cpu().clone()).float()
        for name, p in module.named_parameters()
    }
