"""What hplab's strategies do not compose (yet), each with the sentence that says why.

Each entry is (refused(layout, model), the Layout fields behind it, the reason). `validate`
(hplab/config.py) raises a LayoutError with the reason of the first that applies; the table
"What does not compose yet, and why" in docs/command-line.md lists them word for word
(tests/test_house.py), and the composition matrix (tests/test_composition.py) checks that every
pair of features it does not run is two choices of one setting or one of these.
"""

REFUSALS = [
    (
        lambda c, m: c.zero == 3 and c.pp > 1,
        ("zero", "pp"),
        "ZeRO-3 with a pipeline would gather every layer again for every microbatch's forward "
        "and backward, or, kept gathered across the step's microbatches as torchtitan keeps "
        "them, hold its whole stage like ZeRO-1/2 for most of the step (DeepSpeed and "
        "Colossal-AI refuse it); use ZeRO-1 or 2",
    ),
    (
        lambda c, m: c.sequence_parallel and c.tp == 1,
        ("sequence_parallel", "tp"),
        "sequence parallel splits the sequence over the tensor-parallel group, so it needs 2 or "
        "more tp ranks",
    ),
    (
        lambda c, m: c.zero == 2 and c.pp > 1 and c.schedule == "zb-h1",
        ("zero", "schedule"),
        "ZeRO-2 reduce-scatters each layer's gradients as backward finishes them, and ZB-H1 "
        "defers weight gradients; use ZeRO-1",
    ),
    (
        lambda c, m: c.offload and c.zero == 0,
        ("offload", "zero"),
        "offload moves ZeRO's sharded optimizer state to the CPU, so it needs ZeRO 1, 2 or 3",
    ),
    (
        lambda c, m: c.prefetch != "both" and c.zero != 3,
        ("prefetch", "zero"),
        "--prefetch chooses when ZeRO-3 gathers each block's parameters, so it needs --zero 3",
    ),
    (
        lambda c, m: c.recompute == "selective" and c.cp > 1,
        ("recompute", "cp"),
        "context parallel's attention already keeps no s×s scores (it recomputes them from a "
        "log-sum-exp per row), and recomputing it would send the ring's K/V again: use "
        "--recompute full or none",
    ),
    (
        lambda c, m: m.n_experts and c.zero == 3,
        ("zero",),
        "experts run with every dimension but ZeRO-3 (its per-layer gathers would gather every "
        "expert on every rank): use ZeRO-1 or 2",
    ),
]
