"""hplab.plan.formulas is the one home of the formulas: it loads without torch, and every module
that used to hold its own copy now hands out the very same function (or equal values)."""

import subprocess
import sys

import pytest

from hplab.plan import formulas as F


def test_imports_without_torch():
    code = "import sys, hplab.plan.formulas; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_old_locations_are_the_same_objects():
    from hplab import lab, plan, viz
    from hplab.models import gpt
    from hplab.parallel import collectives as comm
    from hplab.parallel import pp

    same = [
        (comm.bus_factor, F.bus_factor),
        (lab.alpha_beta_terms, F.alpha_beta_terms),
        (lab.training_flops_per_token, F.training_flops_per_token),
        (pp.bubble_formula, F.bubble_formula),
        (pp.SCHEDULES, F.SCHEDULES),
        (plan.SCHEDULES, F.SCHEDULES),
        (plan.model_state_bytes, F.model_state_bytes),
        (plan.activation_bytes_per_layer, F.activation_bytes_per_layer),
        (plan.flops_per_step, F.flops_per_step),
        (plan.PRECISION_BYTES, F.PRECISION_BYTES),
        (plan.in_flight_microbatches, F.in_flight_microbatches),
        (plan.bubble_ratio, F.bubble_ratio),
        (viz.model_state_bytes, F.model_state_bytes),
    ]
    for old, new in same:
        assert old is new
    for name, config in gpt.PRESETS.items():
        shape = plan.model_presets()[name]
        assert config.num_params() == shape.num_params()
        if config.arch == "gpt2":  # (a Llama's Ψ: tests/test_llama.py counts its modules)
            assert config.num_params() == F.gpt_num_params(
                config.n_layer, config.n_embd, config.vocab_size, config.n_positions
            )
        assert (shape.n_layer, shape.n_embd, shape.n_head, shape.seq_len, shape.vocab_size) == (
            config.n_layer,
            config.n_embd,
            config.n_head,
            config.n_positions,
            config.vocab_size,
        )
    assert gpt.PRESETS["gpt2"].num_params() == 124_439_808  # GPT-2 small, tied head


def test_train_accepts_exactly_the_schedules():
    from hplab.cli import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "schedule")
    assert tuple(action.choices) == F.SCHEDULES


@pytest.mark.parametrize("schedule", F.SCHEDULES)
def test_bubble_fraction_and_ratio_are_one_definition(schedule):
    for p, m, v in ((1, 4, 2), (4, 8, 2), (8, 32, 4)):
        v = v if schedule == "interleaved" else 1
        r = F.bubble_ratio(schedule, p, m, v)
        assert F.bubble_fraction(schedule, p, m, v) == pytest.approx(r / (1 + r))
    assert F.bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)  # (p−1)/(m+p−1)
    assert F.bubble_ratio("zb-h1", 4, 8) == pytest.approx(F.bubble_ratio("1f1b", 4, 8) / 3)
    with pytest.raises(ValueError, match="unknown schedule"):
        F.bubble_formula("pipedream", 4, 8)


def test_bus_factor_and_alpha_beta_agree():
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send"):
        for n in (2, 4, 8):
            assert F.alpha_beta_terms(op, n)[1] == F.bus_factor(op, n)
    assert F.alpha_beta_terms("all_reduce", 4) == (6, 1.5)


def test_moe_parameter_count_matches_the_module():
    """gpt_num_params with E experts adds exactly what moe.py's layer adds over one MLP."""
    from hplab.models.gpt import MLP, GPTConfig
    from hplab.parallel import moe

    h, E, config = 8, 4, GPTConfig(n_embd=8, n_head=2)
    layer, mlp = moe.MoE(h, E, 2, lambda: MLP(config)), MLP(config)
    added = sum(p.numel() for p in layer.parameters()) - sum(p.numel() for p in mlp.parameters())
    assert F.gpt_num_params(3, h, 32, 16, E) - F.gpt_num_params(3, h, 32, 16) == 3 * added


def test_collective_time_of_several_calls():
    # 5 all-to-alls among 4 ranks moving 8 GB in all: 5·3 latency steps, (4-1)/4 of 8 GB over β
    assert F.collective_time_s("all_to_all", 8e9, 4, 1e9, 1e-6, calls=5) == pytest.approx(
        3 / 4 * 8 + 5 * 3 * 1e-6
    )


def test_tensor_parallel_activations_at_t1_are_the_planners_and_measured():
    """At t = 1 the tensor-parallel formula is the planner's count and what one forward pass
    saves (the 2-rank runs are checked against it in lab 04)."""
    import torch

    from hplab import plan
    from hplab.models.gpt import build_model, config_from_preset
    from hplab.observe.memory import MemoryLedger

    s, b, h, a, L, V = 64, 8, 64, 4, 4, 2048
    parts = F.tensor_parallel_activation_bytes(s, b, h, a, L, V)
    lay = plan.Layout(batch_size=b, precision="fp32")
    planned = plan.activation_memory(plan.model_presets()["tiny"], lay)
    assert sum(parts.values()) == planned["per_microbatch_model_bytes"]
    model, tokens = build_model(config_from_preset("tiny")), torch.randint(0, V, (b, s + 1))
    ledger = MemoryLedger()
    with ledger.track_activations(exclude=list(model.parameters())):
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert abs(ledger.activation_bytes / sum(parts.values()) - 1) < 0.01


def test_tensor_parallel_activations_split_as_table_2():
    s, b, h, a, L, V, t = 64, 8, 64, 4, 4, 2048, 2
    one = F.tensor_parallel_activation_bytes(s, b, h, a, L, V)
    tp = F.tensor_parallel_activation_bytes(s, b, h, a, L, V, t)
    sp = F.tensor_parallel_activation_bytes(s, b, h, a, L, V, t, sequence_parallel=True)
    sbh = s * b * h
    assert tp["blocks"] == L * (4 * sbh * (4 + 12 / t) + 4 * a * s * b / t)
    assert sp["blocks"] == one["blocks"] / t  # sequence parallel cuts every block tensor
    assert sp["head inputs"] == tp["head inputs"] / t == one["head inputs"] / t
    assert tp["logits"] == one["logits"] / t == tp["loss's exp (vocab parallel)"]
    assert one["loss's exp (vocab parallel)"] == 0


def test_zero3_on_a_link_prefetch_leaves_the_first_gathers_and_last_reduce_scatters():
    """A root of 4 kB and three 2 kB blocks on 2 ranks, 1 MB/s, 1 ms: each transfer takes
    α + S/2/β, 3 ms for the root, 2 ms for a block; 3 transfers per unit."""
    root, block = 3e-3, 2e-3

    def cost(prefetch):
        return F.zero3_link_seconds([4e3, 2e3, 2e3, 2e3], 2, 1e6, 1e-3, prefetch)

    total = 3 * (root + 3 * block)
    assert cost("none")["total_s"] == pytest.approx(total)
    assert cost("none")["exposed_s"] == pytest.approx(total) and cost("none")["hidden"] == 0
    # root twice, the first block's gather and reduce-scatter, the root's reduce-scatter
    both = 3 * root + 2 * block
    assert cost("both")["exposed_s"] == pytest.approx(both)
    assert cost("both")["hidden"] == pytest.approx(1 - both / total)
    # forward only: every block's gather and the later reduce-scatters come back in backward
    assert cost("forward")["exposed_s"] == pytest.approx(both + 3 * block + 2 * block)
    assert cost("backward")["exposed_s"] == pytest.approx(both + 2 * block)  # forward's gathers
    with pytest.raises(ValueError, match="unknown prefetch"):
        F.zero3_link_seconds([1.0, 1.0], 2, 1.0, prefetch="sometimes")


def test_ddp_exposed_comm_by_hand():
    """Two buckets of 1 MB on a 1 MB/s link with α = 0.1 s per ring step (2 ranks: an
    all-reduce is 2 steps of α + (S/2)/β, so 2α + S/β: bus bytes = payload)."""
    one = F.ddp_exposed_comm_s([2e6], window_s=1.0, n=2, bw=1e6, alpha=0.1)
    assert one == pytest.approx(0.2 + 2.0)  # one bucket: all of it after backward
    # the first bucket is ready halfway through the window, the second at its end
    two = F.ddp_exposed_comm_s([1e6, 1e6], window_s=1.0, n=2, bw=1e6, alpha=0.1)
    assert two == pytest.approx(0.5 + 1.2 + 1.2 - 1.0)
    # the second is a tied embedding's: complete only at the end; the first, steady over W
    tied = F.ddp_exposed_comm_s([1e6, 1e6], window_s=1.0, n=2, bw=1e6, alpha=0.1, tied_bytes=1e6)
    assert tied == pytest.approx(1.0 + 1.2 + 1.2 - 1.0)
    # α per step: 100 buckets of 20 kB on a fast link cost 100 · 2α, hidden up to W
    many = F.ddp_exposed_comm_s([2e4] * 100, window_s=1.0, n=2, bw=1e9, alpha=0.1)
    assert many == pytest.approx(100 * 0.2 + 100 * 2e4 / 1e9 - 1.0 + 0.02, rel=0.02)
    # four ranks: the ring's bus bytes, 2(n-1)/n = 1.5 payloads
    assert F.ddp_exposed_comm_s([2e6], 1.0, 4, 1e6, 0.0) == pytest.approx(3.0)


def test_ddp_bucket_speedup_bound():
    # the tied part bounds it: (C + X) / (C + X_tied)
    assert F.ddp_bucket_speedup_bound(1.0, 1.0, 1.0, 0.4) == pytest.approx(2.0 / 1.4)
    # a short window bounds it: (C + X) / (C + X - W)
    assert F.ddp_bucket_speedup_bound(1.0, 0.2, 1.0, 0.4) == pytest.approx(2.0 / 1.8)


def test_ring_attention_hides_all_hops_but_the_last_one_home():
    """One hop per layer and step stays exposed, the last dK/dV accumulator going home: its
    share is one block over all the bytes ring_attention_bytes counts."""
    assert F.ring_attention_hidden(2) == 3 / 4
    for cp in range(2, 9):
        sent = F.ring_attention_bytes(1, 64 * cp, 8, cp)
        hops = (sent["forward"] + sent["backward"]) / (2 * 64 * 8 * 4)  # one block: 2·b·(s/cp)·h·4
        assert hops == 3 * cp - 2
        assert 1 - F.ring_attention_hidden(cp) == pytest.approx(1 / hops)
