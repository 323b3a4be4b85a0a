"""Labs 02 and 03: a tiny GPT trained on n ranks, checked against one process on the whole batch."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hplab.models.gpt import build_model, config_from_preset
from hplab.parallel.mesh import Mesh


def gpt_reference(mesh: Mesh, steps: int, lr: float = 0.0) -> SimpleNamespace:
    """`steps` batches of 2 sequences per rank (`rows`: this rank's) and one process's result on
    each: the global-batch gradient (each rank's loss / n, in rank order) and params after AdamW."""
    n = mesh.world.size
    r = mesh.world.rank
    config = config_from_preset("tiny", n_layer=2, n_embd=32, n_head=2, seq_len=16)
    batches = torch.randint(
        0,
        config.vocab_size,
        (steps, n, 2, config.n_positions + 1),
        generator=torch.Generator().manual_seed(0),
    )  # + the next token
    model = build_model(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)
    grads = []
    params = []
    for batch in batches:
        model.zero_grad()
        for rows in batch:
            (model(rows[:, :-1], rows[:, 1:])[1] / n).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()  # lr = 0 (lab 02) leaves the parameters as they are
        params.append([p.detach().clone() for p in model.parameters()])
    return SimpleNamespace(
        config=config,
        grads=grads,
        params=params,
        rows=[(b[r, :, :-1], b[r, :, 1:]) for b in batches],
    )


def backward_in_sandbox(env, rows) -> None:
    """(In the learner's sandbox.) One backward of the model the driver built, on this rank's
    rows, its gradients zeroed first."""
    env.state["model"].zero_grad()
    env.state["model"](*rows)[1].backward()
