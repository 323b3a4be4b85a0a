"""A ZeroOptimizer's state for checkpoints: its shards made whole, and cut again.

ZeRO-1/2 (hplab/parallel/zero.py) keeps each rank's 1/n of every flat bucket's fp32 master and
optimizer state. A checkpoint wants them whole, by parameter and in the single-device names, so
that any other layout can read them: `full_state()` all-gathers each bucket's shards and cuts
the whole bucket back into its parameters; `load_full_state()` does the reverse, with no
message (every rank is handed the whole state and keeps its own shards). torch's own
`consolidate_state_dict(to)` / `state_dict()` / `load_state_dict()` sit on top, as
ZeroRedundancyOptimizer has them. A mixin of ZeroOptimizer: it reads the optimizer's buckets,
its frozen parameters and its inner optimizer.
"""

from __future__ import annotations

import torch

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
