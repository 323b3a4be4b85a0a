"""Lab 00: memory by hand (one process: nothing is distributed yet)."""

from __future__ import annotations

import torch

from hplab.config import ModelConfig
from hplab.course.check.report import Report
from hplab.course.check.sandbox import forbidden
from hplab.models.gpt import build_model, config_from_preset
from hplab.observe.memory import MemoryLedger, model_state_tensors


def count_in_sandbox(env, function: str, config: ModelConfig):
    """(In the learner's sandbox.) Their `function`(config), with config.num_params() — the
    answer the lab asks them to work out — refusing to run."""
    with forbidden(
        ModelConfig,
        "num_params",
        "config.num_params()",
        "it is the answer — count the parameters of the layers in hplab/models/gpt.py yourself",
    ):
        return getattr(env.learner, function)(config)


def check_memory(module, report: Report) -> None:
    """The learner's Ψ and model-state bytes against the model's parameters and what the
    MemoryLedger measures after one AdamW step, for three model shapes."""
    for L, h, a, S in [(4, 64, 4, 64), (2, 32, 2, 16), (3, 48, 3, 40)]:  # n_head a, seq_len S
        config = config_from_preset("tiny", n_layer=L, n_embd=h, n_head=a, seq_len=S)
        V = config.vocab_size
        model = build_model(config, seed=0)
        x = torch.randint(0, V, (2, S))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        model(x, x)[1].backward()
        opt.step()
        psi = sum(p.numel() for p in model.parameters())
        measured = MemoryLedger().measure(model_state_tensors(model, opt))
        with report.case(f"num_params(V={V} S={S} h={h} L={L})"):
            mine = module.run(count_in_sandbox, "num_params", config)
            hint = {
                V * h: "the LM head shares the token embedding: count it once",
                -S * h: "the position embeddings are parameters too",
                -2 * h: "the final layer norm ln_f has 2h parameters",
                -L * 4 * h: "each block has two layer norms of 2h parameters",
                -L * 9 * h: "every linear layer has a bias",
            }.get(mine - psi)
            report.add(
                mine != psi
                and f"you count {mine:,}, the model has {psi:,} (you are off by {mine - psi:+,})"
                + f" — {hint}" * bool(hint),
                f"Ψ = {mine:,}",
            )
        with report.case(f"model_state_bytes(V={V} S={S} h={h} L={L})"):
            claimed = module.run(count_in_sandbox, "model_state_bytes", config)
            wrong = (
                [
                    f"{kind}: you say {claimed.get(kind)!r}, measured {measured[kind]:,} "
                    f"({measured[kind] / psi:g} bytes per parameter)"
                    for kind in ("params", "grads", "optim")
                    if claimed.get(kind) != measured[kind]
                ]
                if isinstance(claimed, dict)
                else [
                    f"returned {type(claimed).__name__}, expected a dict {{params, grads, optim}}"
                ]
            )
            report.add(
                "; ".join(wrong),
                "params, grads and AdamW state match the MemoryLedger: "
                f"{sum(measured.values()):,} bytes",
            )
