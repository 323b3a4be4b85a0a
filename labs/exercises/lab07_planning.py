"""Lab 07 exercise: the two formulas a planner starts from.

Implement both functions, then compare them with hplab's planner over a grid of model sizes,
data-parallel sizes, ZeRO stages, precisions, pipeline depths and microbatch counts:

    python -m hplab.check planning                 # checks this file
    python -m hplab.check planning path/to/yours.py
"""


def model_state_bytes_per_gpu(psi: float, dp: int, zero: int, precision: str) -> float:
    """Bytes of model states on one GPU: Ψ parameters trained with Adam over `dp`
    data-parallel ranks with ZeRO stage `zero` (0 = plain DDP), [ZeRO] Sec. 5; a float (Ψ/dp
    need not be whole). Bytes per parameter of each kind, unsharded:
        precision "fp32":            params 4, grads 4, Adam's two moments 8, no master copy
        precision "bf16" or "fp16":  params 2, grads 2, Adam's two moments 8, fp32 master 4
    Which kinds a stage shards is lab 03's first table.

    Checked against the planner (`hplab.plan.formulas.model_state_bytes`) for every stage, fp32
    and bf16, Ψ of 335,232, 1.5 B and 175 B, and dp of 1, 3, 8 and 64, to 1e-9 relative."""
    raise NotImplementedError("model_state_bytes_per_gpu")


def bubble_fraction(pp: int, microbatches: int) -> float:
    """The bubble fraction of a GPipe or 1F1B pipeline of `pp` stages running `microbatches`
    microbatches of equal cost: the share of the step a stage sits idle, the curve
    `hplab.viz.plot_bubble_fraction` draws ([PTD-P] Sec. 2.2). pp = 1: no pipeline, no bubble.

    Checked against `hplab.plan.formulas.bubble_fraction` for pp of 1, 2, 4 and 8 and 1, 4, 8 and 32
    microbatches, to 1e-9 relative."""
    raise NotImplementedError("bubble_fraction")
