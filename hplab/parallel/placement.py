"""Where each parameter lives: one typed record per parameter.

Every strategy changes where a parameter's numbers are. Tensor parallel keeps a slice of it,
fully_shard a row block of that slice, ZeRO-1/2 a piece of a flat bucket of many parameters,
expert parallel some experts and not others. What the rest of training must do follows from
those facts alone: which gradients are sums still owed over some ranks (sequence parallel's
whole parameters, GQA's K/V heads shared by several tp ranks), which ranks count an element in
the global gradient norm, how a checkpoint glues a parameter back and cuts it again, which
parameters get weight decay. So the facts are written down once, here, as a `ParamPlacement`:

    per mesh dimension, in DTensor's words      what DTensor has no word for
    tp   Shard(dim) or Replicate()              `split`: fused Q|K|V blocks, a padded
         (its gradient: Partial() when each       vocabulary, K/V heads held by `replicas`
         rank saw only its s/T tokens)            ranks (their gradient Partial over those)
    dp   Replicate(), Shard(0) (fully_shard)    FlatShard: ZeRO's piece of a flat bucket
    cp   Replicate() (cp cuts tokens, not weights)
    ep   experts: each rank holds E/ep of them, each replicated over its edp ranks
    pp   the tied embedding / LM head: one copy on the first stage, one on the last
         (`pipeline_ends`; its gradient Partial over the two)
                                                `no_decay` (by role), `synced_by` (the one
                                                wrapper that averages its gradient over dp)

The strategies record what they did with `update(p, ...)` and read it with `of(p)`; a tensor
standing for a parameter (its fp32 master, its shard) gets a record `derive`d from the
parameter's. The records live in a dictionary keyed by the parameter object (as torch keeps
its own per-tensor state), never as attributes on it: `print(hplab.placement(model))` shows
them all (hplab/observe/placement_table.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

# DTensor's three placements (torch.distributed.tensor's Shard, Replicate and Partial), with
# their names, meanings and printed forms (S(0), R, P(sum)). They are small classes of hplab's
# own: importing DTensor costs a process 2.5 s on a laptop CPU (its operator tables), which
# every rank of every run would pay for three names. `.dtensor()` gives torch's own.


@dataclass(frozen=True)
class Shard:
    """Each rank holds a slice of the tensor along `dim`."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"

    def dtensor(self):
        from torch.distributed.tensor import Shard

        return Shard(self.dim)


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __str__(self) -> str:
        return "R"

    def dtensor(self):
        from torch.distributed.tensor import Replicate

        return Replicate()


@dataclass(frozen=True)
class Partial:
    """Every rank holds a tensor of the whole shape, a part of it: the whole is their sum."""

    reduce_op: str = "sum"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def dtensor(self):
        from torch.distributed.tensor import Partial

        return Partial(self.reduce_op)


@dataclass(frozen=True)
class Split:
    """A piece of the full tensor cut along `dim`, each of its `fused` blocks (c_attn's Q|K|V)
    on its own; `full_size`: the size before zero padding to a multiple of T (a vocabulary);
    `replicas`: consecutive ranks holding the same piece (fewer K/V heads than ranks)."""

    dim: int
    fused: int = 1
    full_size: int | None = None
    replicas: int = 1


@dataclass(frozen=True)
class FlatShard:
    """ZeRO-1/2's cut: the parameter lies end to end with others in a flat bucket, padded to a
    multiple of n and cut into n equal pieces over the group `over`; not along any of its own
    dimensions, so a piece may hold the end of one parameter and the start of the next."""

    over: str
    parts: int

    def __repr__(self) -> str:
        return f"Flat(1/{self.parts})"


@dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter (or a tensor standing for it) lives; see the module's docstring."""

    split: Split | None = None  # tensor parallel's cut (None: whole over tp)
    tp_grad: Partial | Replicate | None = None  # Partial: each tp rank's gradient is a part
    dp: Replicate | Shard | FlatShard = Replicate()  # this tensor, over data parallel
    sharded_over: str = ""  # the group dp's shard is cut over: "dp", "dp_cp", "edp_cp"
    zero: FlatShard | None = None  # ZeRO-1/2: its optimizer state (stage 2: grads) sharded
    expert: bool = False  # an expert's: on its ep rank only, replicated over edp
    expert_parallel: int = 1  # over how many ranks its layer's experts are shared out (ep)
    pipeline_ends: bool = False  # tied embedding / LM head: a copy on the first and last stage
    no_decay: bool = False  # no weight decay (biases, norms, embeddings: by role)
    synced_by: str | None = None  # the wrapper that averages its gradient over dp
    global_shape: tuple[int, ...] | None = None  # before any cut (None: its own shape)

    @property
    def tp(self) -> Shard | Replicate:
        return Replicate() if self.split is None else Shard(self.split.dim)

    @property
    def kv_replicas(self) -> int:
        """How many tp ranks hold the same piece (1 but for K/V heads shared by several)."""
        return 1 if self.split is None else self.split.replicas

    @property
    def partial_grad_over(self) -> tuple[str, ...]:
        """The groups over which this rank's backward computes only a part of the gradient:
        "tp" (sequence parallel), "tp_kv" (shared K/V heads): tp's hooks sum the parts;
        "pp_ends" (the tied embedding): the pipeline executor sums them after its backward."""
        over = ("tp",) if isinstance(self.tp_grad, Partial) else ()
        over += ("tp_kv",) if self.kv_replicas > 1 else ()
        return over + (("pp_ends",) if self.pipeline_ends else ())

    @property
    def copies_over(self) -> tuple[str, ...]:
        """The mesh dimensions whose ranks hold the same numbers (before any dp shard):
        cp always, tp unless cut, dp or, for an expert, its edp replicas only."""
        return ("edp" if self.expert else "dp", "cp") + (("tp",) if self.split is None else ())


_RECORDS = WeakIdKeyDictionary()  # parameter → its ParamPlacement (gone with the parameter)


def of(p: torch.Tensor) -> ParamPlacement:
    """`p`'s placement record; a tensor no strategy touched is replicated everywhere."""
    return _RECORDS.get(p, ParamPlacement())


def update(p: torch.Tensor, **changes) -> ParamPlacement:
    """Record that a strategy changed where `p` lives (the fields of ParamPlacement)."""
    _RECORDS[p] = dataclasses.replace(of(p), **changes)
    return _RECORDS[p]


def derive(source: torch.Tensor, target: torch.Tensor, **changes) -> ParamPlacement:
    """`target` stands for `source` (its fp32 master, its shard): it lives where `source` does,
    but for `changes`; no wrapper syncs its gradient until one claims it."""
    record = of(source)
    fields = {"synced_by": None, "global_shape": record.global_shape or tuple(source.shape)}
    _RECORDS[target] = dataclasses.replace(record, **(fields | changes))
    return _RECORDS[target]


def counted_here(t: torch.Tensor, mesh, tied: bool = False) -> bool:
    """Whether this rank counts `t`'s elements in a global norm: each element once, on the rank
    with coordinate 0 along every dimension holding copies of it (a dp shard is no copy; the
    pipeline's `tied` embedding is counted on the first stage)."""
    record = of(t)
    dims = set(record.copies_over) | ({"pp"} if tied else set())
    dims -= set(record.sharded_over.split("_"))  # e.g. dp_cp: neither dp nor cp holds copies
    return all(getattr(mesh, f"{dim}_rank") == 0 for dim in dims)
