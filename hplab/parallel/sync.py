"""Who averages a parameter's gradient over data parallel: one wrapper, never two.

`hplab.DDP` all-reduces gradients in backward, ZeRO-2 (`hplab.ZeroOptimizer(stage=2)`)
reduce-scatters them in backward, `hplab.fully_shard` reduce-scatters its shards' gradients.
Two of them on the same parameters reduce the same gradient twice in one backward, the second
reading a half-reduced or already averaged one: the model trains silently wrong (0.5× the true
gradient for DDP with 25 MiB buckets around ZeRO-2). Each wrapper claims its parameters when it
is built, and the second one is refused there, before any collective, in one line. ZeRO-1
reduces at `step()`, after DDP's average, so DDP + ZeRO-1 is right (only wasteful): it checks
but does not claim.
"""

from __future__ import annotations

from hplab.parallel import placement


class DoubleSyncError(ValueError):
    """Two wrappers would both average the same parameters' gradients (a wrong gradient)."""


def shared_out(p) -> bool:
    """An expert that expert parallel shared out: this rank holds E/ep of its layer's experts."""
    return placement.of(p).expert_parallel > 1


def claim_gradient_sync(params, by: str, allowed=(), claim: bool = True, expert_group=None) -> None:
    """Record that `by` averages these parameters' gradients over data parallel (their
    placement's `synced_by`); raise a DoubleSyncError if another wrapper (not in `allowed`)
    already does. `claim=False` checks only (ZeRO-1, which is correct after DDP but not on
    fully_shard's shards). Experts shared out over ep need their own group (DDP's
    `expert_group`); a pipeline's tied embedding needs its gradient whole after backward."""
    params = list(params)
    mixes_experts = expert_group is None and any(map(shared_out, params))
    if by in ("hplab.DDP", "hplab.fully_shard") and mixes_experts:
        raise DoubleSyncError(
            f"{by}: these parameters include experts that expert parallel shares out (each rank "
            "holds E/ep of them), and averaging them over the whole group mixes different "
            "experts: use hplab.DDP(model, dp, expert_group=edp), or ZeroOptimizer with the "
            "experts in a param group whose shard_over is their edp group"
        )
    if by == "hplab.fully_shard" and any(placement.of(p).pipeline_ends for p in params):
        raise DoubleSyncError(
            "hplab.fully_shard: these parameters include a pipeline stage's copy of the tied "
            "embedding, whose gradient the first and last stage sum after backward, and "
            "fully_shard keeps only a shard of it: use DDP or ZeroOptimizer under a pipeline"
        )
    for p in params:
        other = placement.of(p).synced_by
        if other and other not in allowed:
            use = (
                "use hplab.fully_shard alone, with a plain torch optimizer on its shards"
                if "fully_shard" in by + other
                else "wrap the model once"
                if by == other
                else "use ZeroOptimizer on the bare model (it averages the gradients itself, "
                "as ZeroRedundancyOptimizer does), or stage=1 inside DDP"
            )
            raise DoubleSyncError(
                f"{by}: {other} already averages these parameters' gradients, and a second "
                f"reduction in the same backward gives wrong gradients: {use}"
            )
    if claim:
        for p in params:
            placement.update(p, synced_by=by)


def check_expert_group(module, dp, experts) -> None:
    """`experts` (the experts' replicas) must be dp's ranks that hold the same experts: dp/ep
    of them, where ep is how many ranks the experts are shared out over."""
    ep = max((placement.of(p).expert_parallel for p in module.parameters()), default=1)
    if experts is not None and ep > 1 and experts.size * ep != dp.size:
        raise ValueError(
            f"hplab.DDP: expert_group has {experts.size} ranks, but the experts' replicas are "
            f"dp/ep = {dp.size}/{ep} ranks: give the group of the dp ranks holding this rank's "
            "experts (the mesh's edp)"
        )
