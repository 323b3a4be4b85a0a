"""Mixture of experts: the layer against a plain per-token reference, capacity dropping on a
crafted routing, and expert parallel over 2 and 4 gloo ranks against one process."""

import pytest
import torch
import torch.distributed as dist

import hplab
from hplab.models.gpt import MLP, GPTConfig
from hplab.observe.observers import RoutingStats
from hplab.parallel import moe
from hplab.parallel.collectives import CommLedger, Communicator
from hplab.plan.formulas import moe_all_to_all_bytes
from hplab.runtime.group import new_group
from hplab.runtime.launch import run_distributed

H, E = 8, 4


def make_layer(top_k=2, seed=0, **kwargs) -> moe.MoE:
    torch.manual_seed(seed)
    config = GPTConfig(n_embd=H, n_head=2)
    return moe.MoE(H, E, top_k, lambda: MLP(config), **kwargs)


def inputs(tokens=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, H, generator=g)


def reference_loss(layer, x, w, top_k, renormalize, aux_coef, z_coef):
    """The MoE loss written plainly: token by token, expert by expert."""
    outputs, probs, counts = [], [], [0] * E
    for token in x:
        logits = layer.router.weight @ token
        p = logits.softmax(dim=0)
        gates, chosen = p.topk(top_k)
        if renormalize:
            gates = gates / gates.sum()
        y = torch.zeros(H)
        for gate, e in zip(gates, chosen.tolist()):
            y = y + gate * layer.experts[str(e)](token)
            counts[e] += 1
        outputs.append(y)
        probs.append(p)
    out = torch.stack(outputs)
    f = torch.tensor(counts) / (len(x) * top_k)
    balance = E * sum(f[e] * torch.stack(probs)[:, e].mean() for e in range(E))
    z = torch.stack([torch.logsumexp(layer.router.weight @ t, 0) ** 2 for t in x]).mean()
    return (out * w).sum(-1).mean() + aux_coef * balance + z_coef * z, out


def grads(layer) -> dict:
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def test_layer_equals_the_per_token_reference():
    x, w = inputs()
    for top_k, renormalize in ((2, True), (1, False), (3, True)):
        kw = dict(aux_coef=0.1, z_coef=0.01, renormalize=renormalize)
        layer = make_layer(top_k, **kw)
        xa = x.clone().requires_grad_()
        out = layer(xa.view(4, 6, H))
        ((out.view(-1, H) * w).sum(-1).mean() + layer.aux_loss).backward()
        got, got_x = grads(layer), xa.grad
        layer.zero_grad()
        xb = x.clone().requires_grad_()
        loss, ref_out = reference_loss(layer, xb, w, top_k, **kw)
        loss.backward()
        want = grads(layer)
        torch.testing.assert_close(out.view(-1, H), ref_out, atol=1e-5, rtol=1e-5)
        assert got.keys() == want.keys() and "router.weight" in got
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(got_x, xb.grad, atol=1e-5, rtol=1e-5)


def test_sequence_wise_balance_is_the_mean_of_each_sequences_loss():
    """DeepSeek-V3's sequence-wise balance loss: f_e and P_e per sequence, the losses averaged.
    The plain reference, run on each of the 4 sequences alone and averaged, gives the same loss
    and gradients; and it differs from the batch-wide balance (else the test could not tell)."""
    x, w = inputs()
    kw = dict(aux_coef=0.1, z_coef=0.01, renormalize=True)
    layer = make_layer(2, balance="sequence", **kw)
    xa = x.clone().requires_grad_()
    out = layer(xa.view(4, 6, H))
    loss = (out.view(-1, H) * w).sum(-1).mean() + layer.aux_loss
    loss.backward()
    got, got_x = grads(layer), xa.grad
    layer.zero_grad()
    xb = x.clone().requires_grad_()
    pieces = [reference_loss(layer, xs, ws, 2, **kw)[0] for xs, ws in zip(xb.split(6), w.split(6))]
    want_loss = torch.stack(pieces).mean()
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-5)
    for name, want in grads(layer).items():
        torch.testing.assert_close(got[name], want, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(got_x, xb.grad, atol=1e-5, rtol=1e-5)
    batch_wide = make_layer(2, **kw)
    batch_wide(x.view(4, 6, H))
    assert abs(float(batch_wide.aux_loss.detach()) - float(layer.aux_loss.detach())) > 1e-4


def test_gpt_blocks_are_mixtures_of_experts_and_counted():
    from hplab.models.gpt import build_model

    config = GPTConfig(n_layer=2, n_experts=3, moe_top_k=1)
    model = build_model(config)
    assert all(isinstance(b.mlp, moe.MoE) and len(b.mlp.experts) == 3 for b in model.transformer.h)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    x = torch.randint(0, config.vocab_size, (2, 8))
    _, loss = model(x, x)
    dense_loss = torch.nn.functional.cross_entropy(model(x)[0].flatten(0, 1), x.flatten())
    aux = sum(b.mlp.aux_loss for b in model.transformer.h)
    assert float(aux.detach()) > 0 and torch.allclose(loss, dense_loss + aux)


def test_capacity_drops_the_latest_slots_per_expert():
    layer = make_layer(top_k=1, capacity_factor=1.0)  # capacity = ceil(1 · 8 · 1 / 4) = 2
    stats = RoutingStats(layer)
    with torch.no_grad():  # the router reads the first E features: token t goes to `route[t]`
        layer.router.weight.copy_(torch.eye(E, H) * 10)
    route = [0, 0, 0, 1, 0, 2, 2, 2]
    x = torch.eye(E, H)[route] + 0.01 * torch.randn(8, H)
    with stats.step():
        out = layer(x)
    dropped = [2, 4, 7]  # expert 0's third and fourth slot, expert 2's third
    for t, e in enumerate(route):
        want = torch.zeros(H) if t in dropped else layer.experts[str(e)](x[t])
        torch.testing.assert_close(out[t], want, atol=1e-6, rtol=1e-6)
    assert stats.per_step == [
        dict(
            tokens_per_expert=[[2, 1, 2, 0]],
            dropped=[3],
            slots=[8],
            aux_loss=float(layer.aux_loss.detach()),
        )
    ]
    layer.top_k, layer.capacity_factor = 2, 0.5  # capacity = ceil(0.5 · 8 · 2 / 4) = 2
    layer(x)
    assert layer.routing["dropped"] == 16 - 2 * E  # 2 per expert kept, 8 of 16 slots dropped


def _expert_parallel(ep_sizes):
    """On every rank: its share of the tokens, the layer expert parallel over each ep size."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, w = inputs(tokens=8 * world)
    mine = slice(rank * 8, (rank + 1) * 8)
    results = {}
    for ep_size in ep_sizes:
        ledger = CommLedger()
        comms = {}
        process_groups = {}  # the same groups as torch's ProcessGroups
        for family, lists in (
            ("ep", [list(range(s, s + ep_size)) for s in range(0, world, ep_size)]),
            ("edp", [list(range(r, world, ep_size)) for r in range(ep_size)]),
            ("dp", [list(range(world))]),
        ):
            for ranks in lists:
                group = new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    comms[family] = Communicator(group, family, ledger, ranks)
                    process_groups[family] = group
        layer = make_layer(aux_coef=0.1, z_coef=0.01)
        returned = moe.parallelize(layer, comms["ep"], comms["dp"])
        ddp = hplab.DDP(layer, comms["dp"], expert_group=comms["edp"])  # the experts: over edp
        xa = x[mine].clone().requires_grad_()
        out = ddp(xa)
        on_process_groups = moe.parallelize(
            make_layer(aux_coef=0.1, z_coef=0.01), process_groups["ep"], process_groups["dp"]
        )
        ((out * w[mine]).sum(-1).mean() + layer.aux_loss).backward()  # averaged in backward
        refusals = {}  # a wrapper that would average the experts over all of dp
        for name, wrap in (
            ("DDP", lambda m: hplab.DDP(m, comms["dp"])),
            ("DDP over the wrong group", lambda m: hplab.DDP(m, None, expert_group=comms["dp"])),
            ("fully_shard", lambda m: hplab.fully_shard(m, comms["dp"])),
            ("ZeroOptimizer", lambda m: hplab.ZeroOptimizer(m.parameters(), torch.optim.SGD)),
        ):
            try:
                wrap(on_process_groups)
            except ValueError as refusal:
                refusals[name] = str(refusal)
        results[ep_size] = dict(
            refusals=refusals,
            out=out.detach(),
            x_grad=xa.grad,
            grads=grads(layer),
            sent=layer.routing["tokens_per_expert"].tolist(),
            a2a=ledger.as_dict()["all_to_all"],
            returns_the_model=returned is layer,
            same_on_process_groups=torch.equal(on_process_groups(x[mine]), out),
        )
    return results


TRAIN = [
    "--no-progress",
    "--n-layer",
    "2",
    "--batch-size",
    "8",
    "--lr",
    "3e-3",
    "--moe-experts",
    "4",
    "--moe-top-k",
    "2",
    "--moe-aux-coef",
    "0.05",
    "--steps",
    "3",
    "--grad-clip",
    "1e9",
]  # never clips: the norm checks the gradients (AdamW hides a scale)
TRAIN_RUNS = {
    4: {
        "dp4 ep4, saved at step 2": ["--dp", "4", "--ep", "4", "--steps", "2", "--save", "{saved}"],
        "dp4 ep2": ["--dp", "4", "--ep", "2"],
        "dp2 ep2 pp2 zb-h1": "--dp 2 --ep 2 --pp 2 --schedule zb-h1 --microbatches 1".split(),
        "tp2 pp2 1f1b, 2 microbatches": "--tp 2 --pp 2 --microbatches 2".split(),
        "dp2 cp2 ep2 recompute": ["--dp", "2", "--cp", "2", "--ep", "2", "--recompute", "full"],
        "dp2 tp2 ep2 selective sp": (
            "--dp 2 --tp 2 --ep 2 --recompute selective --sequence-parallel".split()
        ),
        "dp2 ep2 pp2 1f1b, 4 microbatches, sequence balance": (
            "--dp 2 --ep 2 --pp 2 --microbatches 4 --moe-balance sequence".split()
        ),
        "dp2 cp2 ep2 zero2, 2 microbatches, sequence balance": (
            "--dp 2 --cp 2 --ep 2 --zero 2 --microbatches 2 --moe-balance sequence".split()
        ),
        "dp4 ep2 zero1": "--dp 4 --ep 2 --zero 1 --save {saved}-zero1".split(),
        "dp4 ep2 zero2 resumed": "--dp 4 --ep 2 --zero 2 --bucket-mb 0.01 --resume {saved}".split(),
    },
    1: {
        "one process": ["--save", "{saved}-one"],
        "one process resumed": ["--resume", "{saved}"],
        "one process, sequence balance": ["--moe-balance", "sequence"],
        "one process, 2 microbatches": ["--microbatches", "2"],
    },
}


def _launch(directory: str):
    """One launch: the layer under ep 4 and ep 2 (4 ranks), then train.py's own run() for
    each of TRAIN_RUNS[world]; rank 0 returns everything (the metrics of each run)."""
    from hplab import train, training

    world, clip = dist.get_world_size(), training.clip_grad_norm_
    out = {"layer": _expert_parallel((4, 2)) if world == 4 else None}
    for name, flags in TRAIN_RUNS[world].items():
        flags = [flag.format(saved=f"{directory}/saved") for flag in flags]
        norms = out[f"{name}: gradient norms"] = []
        training.clip_grad_norm_ = lambda *args: norms.append(clip(*args)) or norms[-1]
        out[name] = train.run(train.parse_args(TRAIN + flags))
    training.clip_grad_norm_ = clip
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("moe"))
    four = run_distributed(_launch, 4, directory, timeout_s=300)
    return four, run_distributed(_launch, 1, directory, timeout_s=300)[0], directory


def test_expert_parallel_layer_equals_one_process(runs):
    per_rank, world = [r["layer"] for r in runs[0]], 4
    x, w = inputs(tokens=8 * world)
    layer = make_layer(aux_coef=0.1, z_coef=0.01)
    xa = x.clone().requires_grad_()
    out = layer(xa)
    ((out * w).sum(-1).mean() + layer.aux_loss).backward()
    want = grads(layer)
    for ep in (4, 2):
        local = E // ep
        for rank, result in enumerate(r[ep] for r in per_rank):
            mine = slice(rank * 8, (rank + 1) * 8)
            torch.testing.assert_close(result["out"], out[mine].detach(), atol=1e-5, rtol=0)
            assert result["returns_the_model"] and result["same_on_process_groups"]
            torch.testing.assert_close(
                result["x_grad"] / world, xa.grad[mine], atol=1e-5, rtol=1e-5
            )
            held = {str(e) for e in range(E) if e // local == rank % ep}
            assert {n.split(".")[1] for n in result["grads"] if "experts" in n} == held
            for name, grad in result["grads"].items():
                torch.testing.assert_close(
                    grad, want[name], atol=1e-5, rtol=1e-5, msg=f"ep={ep} rank {rank} {name}"
                )
            group = range(rank - rank % ep, rank - rank % ep + ep)
            received = sum(
                per_rank[r][ep]["sent"][e]
                for r in group
                for e in range(E)
                if e // local == rank % ep
            )
            assert result["a2a"]["calls"] == 5  # counts, dispatch, combine; the last 2 back
            assert result["a2a"]["bytes"] == moe_all_to_all_bytes(
                sum(result["sent"]), received, H, E
            )
            assert result["a2a"]["bus_bytes"] == result["a2a"]["bytes"] * (ep - 1) / ep


def test_no_wrapper_averages_shared_out_experts_over_all_of_dp(runs):
    """DDP without its expert_group (or with a group that is not the experts' replicas),
    fully_shard and a ZeroOptimizer over the whole dp group would average expert e of one
    rank with expert e' of another (silently wrong): each refuses in one line, naming what
    averages them right, before any collective."""
    wrappers = {"DDP", "DDP over the wrong group", "fully_shard", "ZeroOptimizer"}
    for result in (r["layer"][ep] for r in runs[0] for ep in (4, 2)):
        refusals = result["refusals"]
        assert set(refusals) == wrappers, refusals
        for line in refusals.values():
            assert "\n" not in line and "experts" in line and "edp" in line, line


def losses(metrics) -> list[float]:
    return [s["loss"] for s in metrics["steps"]]


def test_train_expert_parallel_and_resharded_resume_equal_one_process(runs):
    four, one = runs[0][0], runs[1]
    reference, norms = losses(one["one process"]), one["one process: gradient norms"]
    assert len(reference) == len(norms) == 3
    for name, run, steps in (
        ("dp4 ep4, saved at step 2", four, slice(0, 2)),
        ("dp4 ep2", four, slice(0, 3)),
        ("dp2 cp2 ep2 recompute", four, slice(0, 3)),
        ("dp2 tp2 ep2 selective sp", four, slice(0, 3)),
        ("dp4 ep2 zero1", four, slice(0, 3)),
        ("dp4 ep2 zero2 resumed", four, slice(2, 3)),
        ("one process resumed", one, slice(2, 3)),
    ):
        assert losses(run[name]) == pytest.approx(reference[steps], rel=1e-5, abs=0), name
        assert run[f"{name}: gradient norms"] == pytest.approx(norms[steps], rel=1e-5), name


def test_zero_with_expert_parallel_saves_what_one_process_holds(runs, tmp_path_factory):
    """ZeRO-1 under ep 2 shards the dense states over dp 4 and each expert's over its 2
    replicas (Megatron's two buffers); its checkpoint, gathered over edp and then ep, holds
    every expert's weights and Adam moments as one process holds them after the same 3 steps."""
    from hplab import checkpoint

    directory = runs[2]
    zero, one = (checkpoint.load(f"{directory}/saved-{n}") for n in ("zero1", "one"))
    assert zero["model"].keys() == one["model"].keys()
    assert sum("experts" in name for name in zero["model"]) == 2 * 4 * 4  # layers × E × 4
    # as one vector each (tests/test_ddp.py: Adam turns the key bias's rounding-noise gradient
    # into ±lr steps); v as √v, the gradients' RMS, whose relative error is theirs
    names = list(one["optimizer"])  # (lm_head.weight is wte's: its state is under wte)
    for what, pick in (
        ("weights", lambda saved, n: saved["model"][n]),
        ("exp_avg", lambda saved, n: saved["optimizer"][n]["exp_avg"]),
        ("√exp_avg_sq", lambda saved, n: saved["optimizer"][n]["exp_avg_sq"].sqrt()),
    ):
        got, want = (torch.cat([pick(s, n).flatten() for n in names]) for s in (zero, one))
        assert float((got - want).norm()) <= 1e-5 * float(want.norm()), what
    assert {float(zero["optimizer"][n]["step"]) for n in names} == {3.0}


def test_train_experts_in_a_pipeline_equal_one_process(runs):
    """Each stage's experts learn to balance through the activation it sends
    (`pp.AuxLossRidesAlong`), and the step's loss sums every stage's auxiliary loss. The
    balance loss is counted per microbatch over the dp group (as Megatron's), so a reference
    must see the same tokens in each microbatch: dp2 ep2 pp2 runs one microbatch (the whole
    batch, as one process), tp2 pp2 two (the halves one process with 2 microbatches sees).
    DeepSeek-V3's sequence-wise balance loss needs no such care: 4 or 2 microbatches, over dp
    and cp, against one process with one."""
    one, four = runs[1], runs[0][0]
    for run, reference in (
        ("dp2 ep2 pp2 zb-h1", "one process"),
        ("tp2 pp2 1f1b, 2 microbatches", "one process, 2 microbatches"),
        # counted per sequence, the balance loss is the same however the batch is cut
        ("dp2 ep2 pp2 1f1b, 4 microbatches, sequence balance", "one process, sequence balance"),
        ("dp2 cp2 ep2 zero2, 2 microbatches, sequence balance", "one process, sequence balance"),
    ):
        assert losses(four[run]) == pytest.approx(losses(one[reference]), rel=1e-5, abs=0), run
        norms = four[f"{run}: gradient norms"]
        assert norms == pytest.approx(one[f"{reference}: gradient norms"], rel=1e-5), run


def test_train_metrics_count_the_routing_and_the_all_to_all_bytes(runs):
    metrics, seq = runs[0][0]["dp4 ep2"], 64
    experts = metrics["experts"]
    assert experts["n_experts"] == E and experts["ep"] == 2
    recomputed = runs[0][0]["dp2 cp2 ep2 recompute"]["experts"]  # its forward counted once
    for step in range(3):
        for layer in range(2):
            for counted in (experts, recomputed):
                sent = [counted["tokens_per_expert"][r][step][layer] for r in range(4)]
                assert sum(map(sum, sent)) == 8 * seq * 2  # dropless: each token, 2 experts
                assert all(counted["dropped"][r][step][layer] == 0 for r in range(4))
    for rank in range(4):  # ep groups {0, 1} and {2, 3}; rank r holds experts 2·(r % 2) + {0, 1}
        group, mine = (
            range(rank - rank % 2, rank - rank % 2 + 2),
            (2 * (rank % 2), 2 * (rank % 2) + 1),
        )
        want = sum(
            moe_all_to_all_bytes(
                sum(experts["tokens_per_expert"][rank][step][layer]),
                sum(experts["tokens_per_expert"][r][step][layer][e] for r in group for e in mine),
                64,
                E,
            )
            for step in range(3)
            for layer in range(2)
        )
        assert metrics["comm_by_group"][rank]["ep"]["all_to_all"]["bytes"] == want


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ("--ep 3 --moe-experts 4", "--ep 3 must divide --moe-experts (4) and --dp (4)"),
        ("--ep 2", "--ep 2 shares out a mixture of experts, and this model has none"),
        (
            "--moe-experts 4 --moe-top-k 5",
            "--moe-top-k 5 must be between 1 and the number of experts",
        ),
        ("--moe-experts 4 --moe-capacity-factor 0", "--moe-capacity-factor: must be a positive"),
        (
            "--moe-experts 4 --dp 4 --zero 3",
            "--zero 3: not supported: experts run with every dimension but ZeRO-3",
        ),
    ],
)
def test_bad_expert_layouts_are_one_line_before_any_process(flags, says, capsys):
    from hplab import train

    assert train.main(["--nproc", "4", "--steps", "1", *flags.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
