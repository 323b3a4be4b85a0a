"""Context parallel (hplab/cp.py): ring attention (contiguous and zig-zag) and Ulysses.

Attention on N ranks, each holding its tokens of one sequence, must equal PyTorch's causal
`scaled_dot_product_attention` on the whole sequence: the output and dQ, dK, dV of a random
upstream gradient (fp32, rtol 1e-5). The ring's bytes per step are checked against the
formula. One launch per world size runs every check and returns plain numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hplab import cp
from hplab.dist import run_distributed

RTOL, ATOL = 1e-5, 1e-6
B, HEADS, SEQ, D = 2, 4, 16, 8  # SEQ splits into 2N chunks for N = 2 and 4


def full_inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(B, HEADS, SEQ, D, generator=g) for _ in range(4))
    return q, k, v, d_out


def reference():
    """One process, the whole sequence: PyTorch's attention, output and gradients."""
    q, k, v, d_out = full_inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.backward(d_out)
    return {"out": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def attention_worker():
    """Every style and split on this rank's tokens; returns its shards and the ring's bytes."""
    from hplab.comm import CommLedger, Communicator
    import torch.distributed as dist

    ledger = CommLedger()
    comm = Communicator(None if dist.get_world_size() == 1 else dist.group.WORLD, "cp", ledger)
    results = {}
    for style, split in (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "zigzag"),
                         ("ulysses", "contiguous")):
        ledger.reset()
        attend = cp.ring_attention if style == "ring" else cp.ulysses_attention
        mine = [cp.shard(t, comm.rank, comm.size, split, dim=2) for t in full_inputs()]
        q, k, v = (t.requires_grad_() for t in mine[:3])
        y = attend(q, k, v, comm, split)
        forward_sends = dict(ledger.by_group_dict()).get("cp", {})
        y.backward(mine[3])
        results[style, split] = {
            "out": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "forward": forward_sends, "all": ledger.by_group_dict().get("cp", {})}
    return results


def gathered(results: list[dict], key, name):
    return cp.unshard([r[key][name] for r in results], key[1], dim=2)


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    return request.param, run_distributed(attention_worker, request.param)


@pytest.mark.parametrize("key", [("ring", "contiguous"), ("ring", "zigzag"),
                                 ("ulysses", "zigzag"), ("ulysses", "contiguous")])
def test_attention_equals_sdpa_on_the_whole_sequence(world, key):
    _, results = world
    ref = reference()
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(gathered(results, key, name), ref[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{key} {name}: {m}")


def test_ring_bytes_per_step_match_the_formula(world):
    """Forward: N-1 K/V blocks sent; backward: N-1 K/V blocks and N dK/dV blocks; each block
    2·b·heads·(s/N)·d fp32 numbers. Every send has its recv."""
    n, results = world
    block = 2 * B * HEADS * (SEQ // n) * D * 4
    for split in ("contiguous", "zigzag"):
        for r in results:
            fwd, both = r["ring", split]["forward"], r["ring", split]["all"]
            assert (fwd["send"]["calls"], fwd["send"]["bytes"]) == (n - 1, (n - 1) * block)
            assert both["send"]["bytes"] == (3 * n - 2) * block == both["recv"]["bytes"]
            assert both["send"]["calls"] == 3 * n - 2


def test_ulysses_moves_four_all_to_alls(world):
    """q, k, v in one all-to-all, the output in another; the same two backward."""
    n, results = world
    for r in results:
        ops = r["ulysses", "zigzag"]["all"]
        assert ops["all_to_all"]["calls"] == 4
        assert ops["all_to_all"]["bytes"] == 8 * B * HEADS * (SEQ // n) * D * 4
        assert "send" not in ops


def test_zigzag_evens_the_causal_work():
    """Pairs of a 16-token sequence: contiguous over 4 ranks is 10, 26, 42, 58 (the diagonal
    n(n+1)/2 plus r full n² blocks); zig-zag gives every rank 10 + 3·8 = 34; both sum to
    s(s+1)/2 = 136."""
    contiguous = [cp.pairs_computed(r, 4, "contiguous", 4) for r in range(4)]
    zigzag = [cp.pairs_computed(r, 4, "zigzag", 4) for r in range(4)]
    assert contiguous == [10, 26, 42, 58] and zigzag == [34] * 4
    assert sum(contiguous) == sum(zigzag) == 16 * 17 // 2


def test_split_and_inverse():
    x = torch.arange(16).view(1, 16)
    assert cp.positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    assert cp.positions(16, 1, 4, "contiguous").tolist() == [4, 5, 6, 7]
    for split in cp.SPLITS:
        assert torch.equal(cp.unshard([cp.shard(x, r, 4, split) for r in range(4)], split), x)


def test_layouts_that_do_not_split_are_refused_in_one_sentence():
    with pytest.raises(cp.ContextParallelError, match="multiple of 8"):
        cp.check_divisible(12, 4, 4, "ring", "zigzag")
    with pytest.raises(cp.ContextParallelError, match="divides 6"):
        cp.check_divisible(16, 6, 4, "ulysses", "contiguous")
    cp.check_divisible(12, 6, 4, "ring", "contiguous")


def test_the_mesh_puts_cp_between_tp_and_dp():
    """Megatron's order: tp innermost, then cp, then dp, then pp (8 ranks, dp2 × cp2 × tp2)."""
    from hplab.dist import LayoutError, check_layout, group_ranks

    groups = group_ranks(dp=2, tp=2, pp=1, cp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(LayoutError, match=r"dp=1 × tp=2 × pp=1 × cp=3 = 6 processes, but "
                                          r"there are 4: make --dp × --tp × --pp × --cp"):
        check_layout(4, 1, 2, 1, 3)
