"""The planner against hplab's own measurements (the MemoryLedger counts real tensors).

Two levels:
  * in this process, on the `tiny` preset: the activations autograd saves in one forward pass,
    and the model states of one real Adam step, against the planner's formulas;
  * a real 4-rank run of train.py (its parse_args and run(), what each rank of `train.py
    --nproc 4` runs) at every ZeRO stage, against the planner's per-kind model-state bytes and
    per-microbatch activation bytes;
  * one short 2-rank run each of context parallel (--cp 2: activations, weights, the ring's
    bytes), expert parallel (--moe-experts 4 --ep 2 --dp 2: weights, all-to-all bytes,
    activations) and ZeRO-3 offload, and a mixture of experts' activations in this process.
The runs share two launches (4 and 2 ranks) instead of a fresh launcher each.

Tolerances: model states must agree up to padding (a flat ZeRO shard is padded to a multiple
of dp; allowed: one element per parameter tensor per kind). Activations within 2 % in-process
(the planner leaves out layer-norm statistics and token-id tensors, about 0.3 % on `tiny`; a
mixture of experts' router numbers, about 1 %) and within 5 % for the train.py runs (under
expert parallel a rank holds the slots the router sent it: -3.6 % and +1.2 % on the two ranks
here). Bytes sent agree exactly: the ledger counts payload, as the formulas do.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hplab import plan as P

ROOT = Path(__file__).resolve().parents[1]
ACTIVATION_TOLERANCE = 0.02
RUN_ACTIVATION_TOLERANCE = 0.05

torch = pytest.importorskip("torch")
gpt = pytest.importorskip("hplab.models.gpt")
memory = pytest.importorskip("hplab.observe.memory")


def _tiny():
    return P.model_presets()["tiny"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("flash", [True, False], ids=["fused", "unfused"])
def test_activation_bytes_of_one_forward_pass(precision, recompute, b, flash):
    cfg = replace(gpt.PRESETS["tiny"], flash_attention=flash)
    model = gpt.build_model(cfg)
    model.recompute = recompute
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (b, cfg.n_positions))
    ledger = memory.MemoryLedger()
    with ledger.track_activations(exclude=list(model.parameters())):
        model(idx, idx)
    lay = P.Layout(batch_size=b, precision=precision, recompute=recompute)
    planned = P.plan(replace(_tiny(), flash_attention=flash), lay)
    planned = planned["activation_bytes_per_microbatch"]
    err = planned / ledger.activation_bytes - 1
    print(
        f"\ntiny {precision} recompute={recompute} b={b} flash={flash}: measured "
        f"{ledger.activation_bytes} planned {planned:.0f} ({err:+.2%})"
    )
    assert abs(err) <= ACTIVATION_TOLERANCE


def test_model_states_of_one_adam_step():
    cfg = gpt.PRESETS["tiny"]
    model = gpt.build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.n_positions))
    model(idx, idx)[1].backward()
    opt.step()
    ledger = memory.MemoryLedger()
    measured = ledger.measure(memory.model_state_tensors(model, opt))
    planned = P.model_state_bytes(_tiny().num_params(), 1, 0, "fp32")
    assert sum(p.numel() for p in model.parameters()) == _tiny().num_params() == cfg.num_params()
    for kind in ("params", "grads", "optim", "master"):
        assert measured[kind] == planned[kind + "_bytes"], kind


def test_offloaded_bytes_are_a_subset_counted_by_kind():
    """`offloaded` names storages already counted under a kind: the ledger says how many bytes of
    each kind are in host memory, and the kinds' totals do not change."""
    weight, grad, state = torch.zeros(10), torch.zeros(10), torch.zeros(20)
    ledger = memory.MemoryLedger()
    held = {"params": [weight], "grads": [grad], "optim": [state, state[:5]]}
    assert ledger.measure(held | {"offloaded": [state, grad]}) == ledger.measure(held)
    ledger.measure(held | {"offloaded": [state[5:], grad]})  # (a view: its storage)
    assert ledger.as_dict()["offloaded_bytes"] == {
        "params": 0,
        "grads": 40,
        "optim": 80,
        "master": 0,
    }


# --- real runs of hplab/train.py: its own run(), in two launches ----------------------------

COMMON = ["--model", "tiny", "--steps", "1", "--no-progress"]
RUNS = {  # world size: {name: train.py's flags}
    4: {f"zero{z}": ["--zero", str(z), "--dp", "4"] for z in range(4)},
    2: {
        "zero3 offload": ["--zero", "3", "--dp", "2", "--precision", "bf16", "--offload"],
        "cp2": ["--cp", "2", "--batch-size", "2"],
        "ep2": "--moe-experts 4 --moe-top-k 2 --ep 2 --dp 2 --batch-size 2".split(),
    },
}


def _train_runs() -> dict:
    """Each of RUNS[world] through train.py's parse_args and run() (what `train.py --nproc N`
    runs on each rank), one after another in this launch; rank 0 returns their metrics as the
    metrics file holds them."""
    import torch.distributed as dist

    from hplab import train

    out = {}
    for name, flags in RUNS[dist.get_world_size()].items():
        out[name] = json.loads(json.dumps(train.run(train.parse_args(COMMON + flags))))
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    from hplab.runtime.launch import run_distributed

    return {
        **run_distributed(_train_runs, 4, timeout_s=600)[0],
        **run_distributed(_train_runs, 2, timeout_s=600)[0],
    }


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_planner_matches_a_real_run(zero, runs):
    metrics = runs[f"zero{zero}"]
    cfg = metrics["config"]
    model = P.model_presets()["tiny"]
    over = {
        k: cfg.get(f)
        for k, f in (
            ("n_layer", "n_layer"),
            ("n_embd", "n_embd"),
            ("n_head", "n_head"),
            ("n_positions", "seq_len"),
        )
        if cfg.get(f)
    }
    model = replace(model, **over)
    dp = int(cfg.get("dp", 4))
    batch = int(cfg.get("batch_size") or dp)
    micro = int(cfg.get("microbatches") or 1)
    if batch % (dp * micro):
        micro = 1
    recompute = cfg.get("recompute", "none")
    lay = P.Layout(
        dp=dp,
        zero=zero,
        batch_size=batch,
        microbatches=micro,
        precision=cfg.get("precision", "fp32"),
        recompute=recompute,
    )
    planned = P.plan(model, lay, padded=True)
    n_tensors = 4 * model.n_layer * 3 + 3  # parameter tensors of GPT-2 (≈ 12 per block)
    elem = P.PRECISION_BYTES[lay.precision]
    print(f"\nZeRO-{zero}: planner vs train.py ({lay.short()})")
    for rank, entry in enumerate(metrics["memory"]):
        for kind, size in zip(("params", "grads", "master", "optim"), elem[:4]):
            want, got = planned[f"{kind}_bytes"], entry[f"{kind}_bytes"]
            print(f"  rank {rank} {kind:7s} planned {want:10.0f} measured {got:10d}")
            assert abs(got - want) <= max(size, 4) * n_tensors, (rank, kind)
        if entry.get("activation_bytes"):
            act = planned["activation_bytes_per_microbatch"]
            err = act / entry["activation_bytes"] - 1
            print(
                f"  rank {rank} activations planned {act:.0f} measured "
                f"{entry['activation_bytes']} ({err:+.2%})"
            )
            assert abs(err) <= RUN_ACTIVATION_TOLERANCE, rank


def test_offload_keeps_zero3s_shards_grads_and_adam_state_on_the_host(runs):
    """`--zero 3 --offload` (FSDP2's CPU offload): the fp32 shards (the masters under bf16),
    their gradients and Adam's state live in host memory, measured by kind; nothing of the
    model states stays on the device between steps."""
    metrics = runs["zero3 offload"]
    shard = _tiny().num_params() // 2  # (tiny's sizes split evenly: no padding)
    for entry in metrics["memory"]:
        host = entry["offloaded_bytes"]
        assert host == {"params": 0, "grads": 4 * shard, "optim": 8 * shard, "master": 4 * shard}
        assert all(entry[f"{kind}_bytes"] == host[kind] for kind in host)


# --- context parallel and experts (issue 12): one short run each --------------------------------


def test_planner_matches_a_context_parallel_run(runs):
    """2 ranks share each sequence (ring attention, zig-zag): each holds half the tokens'
    activations and all the weights; the ring's sends are the planner's bytes, exactly (the
    ledger counts payload), and the gradients are averaged in one all-reduce over dp × cp (here
    the 2 cp ranks: the ranks that hold the same weights), moving what each rank steps."""
    metrics = runs["cp2"]
    lay = P.Layout(cp=2, batch_size=2, precision=metrics["config"]["precision"])
    planned = P.plan(_tiny(), lay)
    for rank, (memory, comm) in enumerate(zip(metrics["memory"], metrics["comm_by_group"])):
        act = planned["activation_bytes_per_microbatch"]
        err = act / memory["activation_bytes"] - 1
        print(
            f"\ncp2 rank {rank}: activations planned {act:.0f} measured "
            f"{memory['activation_bytes']} ({err:+.2%}); ring sent {comm['cp']['send']['bytes']}"
            f" planned {planned['cp_bytes_per_step']:.0f}"
        )
        assert abs(err) <= RUN_ACTIVATION_TOLERANCE, rank
        assert memory["params_bytes"] == planned["params_bytes"], rank
        assert comm["cp"]["send"]["bytes"] == planned["cp_bytes_per_step"], rank
        assert comm["dp_cp"]["all_reduce"]["bytes"] == planned["grads_bytes"], rank
        assert "all_reduce" not in comm["cp"], rank  # (no second average over cp)


def test_planner_matches_an_expert_parallel_run(runs):
    """4 experts, top-2, over ep=2 of dp=2 ranks: each rank holds the dense weights and 2 of the
    experts of each layer, exactly the planner's bytes. A rank's all-to-all bytes depend on where
    the router sent the tokens, but every slot one rank sends, another receives: their mean over
    the ep group is the planner's balanced number, exactly. Activations: within 5 % per rank."""
    metrics = runs["ep2"]
    model = replace(_tiny(), n_experts=4, moe_top_k=2)
    lay = P.Layout(dp=2, ep=2, batch_size=2, precision=metrics["config"]["precision"])
    planned = P.plan(model, lay)
    sent = [comm["ep"]["all_to_all"]["bytes"] for comm in metrics["comm_by_group"]]
    print(
        f"\nep2: all-to-all bytes per rank {sent}, planned (balanced) "
        f"{planned['ep_all_to_all_bytes_per_step']:.0f}"
    )
    assert sum(sent) / len(sent) == planned["ep_all_to_all_bytes_per_step"]
    for rank, memory in enumerate(metrics["memory"]):
        for kind in ("params", "grads", "optim", "master"):
            assert memory[f"{kind}_bytes"] == planned[f"{kind}_bytes"], (rank, kind)
        act = planned["activation_bytes_per_microbatch"]
        err = act / memory["activation_bytes"] - 1
        print(
            f"  rank {rank} activations planned {act:.0f} measured {memory['activation_bytes']}"
            f" ({err:+.2%})"
        )
        assert abs(err) <= RUN_ACTIVATION_TOLERANCE, rank


def test_moe_activation_bytes_of_one_forward_pass():
    """Each token's k = 2 expert slots, in this process (no expert parallel), within 2 %."""
    cfg = replace(gpt.PRESETS["tiny"], n_experts=4, moe_top_k=2)
    model = gpt.build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.n_positions))
    ledger = memory.MemoryLedger()
    with ledger.track_activations(exclude=list(model.parameters())):
        model(idx, idx)
    shape = replace(_tiny(), n_experts=4, moe_top_k=2)
    planned = P.plan(shape, P.Layout(batch_size=2))["activation_bytes_per_microbatch"]
    print(f"\ntiny, 4 experts top-2: measured {ledger.activation_bytes} planned {planned:.0f}")
    assert abs(planned / ledger.activation_bytes - 1) <= ACTIVATION_TOLERANCE
