"""Lab 07 exercise: the two formulas a planner starts from.

Implement both functions, then compare them with hplab's planner over a grid of model sizes,
data-parallel sizes, ZeRO stages, precisions, pipeline depths and microbatch counts:

    python -m hplab.check planning                 # checks this file
    python -m hplab.check planning path/to/yours.py
"""


def model_state_bytes_per_gpu(psi: float, dp: int, zero: int, precision: str) -> float:
    """Bytes of model states on one GPU: Ψ parameters trained with Adam over `dp`
    data-parallel ranks with ZeRO stage `zero` (0 = plain DDP), [ZeRO] Sec. 5.

    Bytes per parameter, before sharding:
        precision "fp32":            params 4, grads 4, optimizer state 8, no master copy
        precision "bf16" or "fp16":  params 2, grads 2, optimizer state 8, fp32 master 4
    Stage 1 divides optimizer state and master weights by dp, stage 2 also the gradients,
    stage 3 also the parameters. Return the total (a float: Ψ/dp need not be whole)."""
    raise NotImplementedError("sum the four kinds, each divided by dp if the stage shards it")


def bubble_fraction(pp: int, microbatches: int) -> float:
    """The bubble fraction of a GPipe or 1F1B pipeline: the share of the step a stage sits
    idle, the curve `hplab.viz.plot_bubble_fraction` draws ([PTD-P] Sec. 2.2). With p stages
    and m microbatches, each stage works m slots and waits p - 1 slots while the pipeline fills
    and drains. (The paper writes the bubble relative to the useful time instead: that is the
    *bubble ratio*, another number. pp = 1: no pipeline, no bubble.)"""
    raise NotImplementedError("the idle slots' share of all the slots of a step")
