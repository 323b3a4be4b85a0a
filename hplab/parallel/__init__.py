"""The course's subject: each way of training on many devices, one file each, built from scratch
on torch.distributed. Read in this order:

    collectives.py  the seven operations every strategy calls, and the ledger that counts them
    mesh.py         this rank's place in the pp × dp × cp × tp grid, and a group per dimension
    ddp.py          data parallel: replicas, gradient buckets, overlap with backward
    zero.py         ZeRO-1/2: the optimizer state (and gradients) sharded over data parallel
    fsdp.py         ZeRO-3 (fully_shard): the parameters sharded too, gathered per unit
    precision.py    bf16 / fp16 compute with fp32 master weights and a loss scale
    tp.py           Megatron's tensor parallel: column and row cuts, sequence parallel
    schedule.py     pipeline schedules as data (GPipe, 1F1B, interleaved, ZB-H1) and a simulator
    pp.py           pipeline parallel: stages, messages, the executor that runs a schedule
    cp.py           context parallel: ring attention (contiguous, zig-zag) and Ulysses
    moe.py          mixture of experts and expert parallel (all-to-all dispatch)
    compose.py      the one place where they are put together (the step: hplab/training.py)

`placement.py` (where each parameter lives: one typed record each, which sync, clipping,
checkpoints and weight decay read), `grad_hooks.py` (gradient hooks that follow a parameter to
fully_shard's stand-in), `sync.py` (one wrapper averages a gradient), `buckets.py`
(gradients grouped into messages) and `optim.py` (optimizers that step other tensors than the
model's) are shared by the strategies above.
"""
