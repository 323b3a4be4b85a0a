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


def claim_gradient_sync(params, by: str, allowed=(), claim: bool = True) -> None:
    """Record that `by` averages these parameters' gradients over data parallel (their
    placement's `synced_by`); raise a DoubleSyncError if another wrapper (not in `allowed`)
    already does. `claim=False` checks only (ZeRO-1, which is correct after DDP but not on
    fully_shard's shards)."""
    params = list(params)
    if by in ("hplab.DDP", "hplab.fully_shard") and any(
        placement.of(p).expert_parallel > 1 for p in params
    ):
        raise DoubleSyncError(
            f"{by}: these parameters include experts that expert parallel shares out (each rank "
            "holds E/ep of them), and averaging them over the whole group mixes different "
            "experts: average with moe.sync_gradients(params, dp, edp) after backward, or use "
            "ZeroOptimizer with the experts in a param group whose shard_over is their edp group"
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
