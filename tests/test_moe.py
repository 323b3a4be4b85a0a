"""Mixture of experts: the layer against a plain per-token reference, capacity dropping on a
crafted routing, and expert parallel over 2 and 4 gloo ranks against one process."""

import torch
import torch.distributed as dist

from hplab import moe
from hplab.comm import CommLedger, Communicator
from hplab.dist import new_group, run_distributed
from hplab.formulas import moe_all_to_all_bytes
from hplab.models.gpt import MLP, GPTConfig

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


def test_capacity_drops_the_latest_slots_per_expert():
    layer = make_layer(top_k=1, capacity_factor=1.0)  # capacity = ceil(1 · 8 · 1 / 4) = 2
    stats = moe.RoutingStats(layer)
    with torch.no_grad():  # the router reads the first E features: token t goes to `route[t]`
        layer.router.weight.copy_(torch.eye(E, H) * 10)
    route = [0, 0, 0, 1, 0, 2, 2, 2]
    x = torch.eye(E, H)[route] + 0.01 * torch.randn(8, H)
    out = layer(x)
    dropped = [2, 4, 7]  # expert 0's third and fourth slot, expert 2's third
    for t, e in enumerate(route):
        want = torch.zeros(H) if t in dropped else layer.experts[str(e)](x[t])
        torch.testing.assert_close(out[t], want, atol=1e-6, rtol=1e-6)
    assert stats.as_dict() == dict(tokens_per_expert=[[2, 1, 2, 0]], dropped=[3], slots=[8],
                                   aux_loss=float(layer.aux_loss.detach()))
    layer.top_k, layer.capacity_factor = 2, 0.5  # capacity = ceil(0.5 · 8 · 2 / 4) = 2
    layer(x)
    assert layer.routing["dropped"] == 16 - 2 * E  # 2 per expert kept, 8 of 16 slots dropped


def _expert_parallel(ep_sizes):
    """On every rank: its quarter (or half) of the tokens, expert parallel over each ep size."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, w = inputs(tokens=8 * world)
    mine = slice(rank * 8, (rank + 1) * 8)
    results = {}
    for ep_size in ep_sizes:
        ledger = CommLedger()
        comms = {}
        for family, lists in (("ep", [list(range(s, s + ep_size))
                                      for s in range(0, world, ep_size)]),
                              ("edp", [list(range(r, world, ep_size)) for r in range(ep_size)]),
                              ("dp", [list(range(world))])):
            for ranks in lists:
                group = new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    comms[family] = Communicator(group, family, ledger, ranks)
        layer = make_layer(aux_coef=0.1, z_coef=0.01)
        moe.parallelize(layer, comms["ep"], comms["dp"])
        xa = x[mine].clone().requires_grad_()
        out = layer(xa)
        ((out * w[mine]).sum(-1).mean() + layer.aux_loss).backward()
        moe.sync_gradients(list(layer.parameters()), comms["dp"], comms["edp"])
        results[ep_size] = dict(out=out.detach(), x_grad=xa.grad, grads=grads(layer),
                                sent=layer.routing["tokens_per_expert"].tolist(),
                                a2a=ledger.as_dict()["all_to_all"])
    return results


def test_expert_parallel_equals_one_process():
    for world, ep_sizes in ((2, (2,)), (4, (4, 2))):
        per_rank = run_distributed(_expert_parallel, world, ep_sizes)
        x, w = inputs(tokens=8 * world)
        layer = make_layer(aux_coef=0.1, z_coef=0.01)
        xa = x.clone().requires_grad_()
        out = layer(xa)
        ((out * w).sum(-1).mean() + layer.aux_loss).backward()
        want = grads(layer)
        for ep in ep_sizes:
            local = E // ep
            for rank, result in enumerate(r[ep] for r in per_rank):
                mine = slice(rank * 8, (rank + 1) * 8)
                torch.testing.assert_close(result["out"], out[mine].detach(), atol=1e-5, rtol=0)
                torch.testing.assert_close(result["x_grad"] / world, xa.grad[mine], atol=1e-5,
                                           rtol=1e-5)
                held = {str(e) for e in range(E) if e // local == rank % ep}
                assert {n.split(".")[1] for n in result["grads"] if "experts" in n} == held
                for name, grad in result["grads"].items():
                    torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=1e-5,
                                               msg=f"ep={ep} rank {rank} {name}")
                group = range(rank - rank % ep, rank - rank % ep + ep)
                received = sum(per_rank[r][ep]["sent"][e] for r in group
                               for e in range(E) if e // local == rank % ep)
                assert result["a2a"]["calls"] == 5  # counts, dispatch, combine; the last 2 back
                assert result["a2a"]["bytes"] == moe_all_to_all_bytes(
                    sum(result["sent"]), received, H, E)
                assert result["a2a"]["bus_bytes"] == result["a2a"]["bytes"] * (ep - 1) / ep
