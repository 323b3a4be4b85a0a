"""Lab 07 solution: model-state memory under ZeRO and the pipeline bubble (see exercises/)."""

BYTES = {"fp32": (4, 4, 8, 0), "bf16": (2, 2, 8, 4), "fp16": (2, 2, 8, 4)}


def model_state_bytes_per_gpu(psi, dp, zero, precision):
    params, grads, optim, master = (b * psi for b in BYTES[precision])
    return (
        params / (dp if zero >= 3 else 1)
        + grads / (dp if zero >= 2 else 1)
        + (optim + master) / (dp if zero >= 1 else 1)
    )


def bubble_fraction(pp, microbatches):
    """p − 1 idle slots out of the m + p − 1 slots of a step."""
    return (pp - 1) / (microbatches + pp - 1)
