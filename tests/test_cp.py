"""Context parallel (hplab/parallel/cp.py): ring attention (contiguous and zig-zag) and Ulysses.

Attention on N ranks, each holding its tokens of one sequence, must equal PyTorch's causal
`scaled_dot_product_attention` on the whole sequence: the output and dQ, dK, dV of a random
upstream gradient (fp32, rtol 1e-5). The ring's bytes per step are checked against the
formula. One launch per world size runs every check and returns plain numbers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from hplab.parallel import cp
from hplab.plan import formulas
from hplab.plan.formulas import CP_SPLITS, ring_attention_bytes
from hplab.runtime.launch import run_distributed

RTOL, ATOL = 1e-5, 1e-6
B, HEADS, SEQ, D = 2, 4, 16, 8  # SEQ splits into 2N chunks for N = 2 and 4


def full_inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(B, HEADS, SEQ, D, generator=g) for _ in range(4))
    return q, k, v, d_out


def reference(dtype=torch.float32):
    """One process, the whole sequence: PyTorch's attention, output and gradients (in fp32, of
    the inputs rounded to `dtype`)."""
    q, k, v, d_out = (t.to(dtype).float() for t in full_inputs())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.backward(d_out)
    return {"out": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def attention_worker():
    """Every style and split on this rank's tokens; returns its shards and the ring's bytes."""
    import torch.distributed as dist

    from hplab.parallel.collectives import CommLedger, Communicator

    ledger = CommLedger()
    comm = Communicator(None if dist.get_world_size() == 1 else dist.group.WORLD, "cp", ledger)
    results = {}
    for key in (
        ("ring", "contiguous"),
        ("ring", "zigzag"),
        ("ulysses", "zigzag"),
        ("ulysses", "contiguous"),
        ("ring", "zigzag", "bf16"),
    ):
        ledger.reset()
        style, split, dtype = *key[:2], torch.bfloat16 if "bf16" in key else torch.float32
        attend = cp.ring_attention if style == "ring" else cp.ulysses_attention
        mine = [
            cp.tokens_of(t.to(dtype), comm.rank, comm.size, split, dim=2) for t in full_inputs()
        ]
        q, k, v = (t.requires_grad_() for t in mine[:3])
        y = attend(q, k, v, comm, split)
        forward_sends = dict(ledger.by_group_dict()).get("cp", {})
        y.backward(mine[3])
        results[key] = {
            "out": y.detach(),
            "dq": q.grad,
            "dk": k.grad,
            "dv": v.grad,
            "forward": forward_sends,
            "all": ledger.by_group_dict().get("cp", {}),
        }
    return results


CONFIG = dict(vocab_size=101, n_positions=16, n_embd=32, n_layer=2, n_head=4)
BATCH, STEPS, TRAINING = 4, 3, dict(lr=1e-3, weight_decay=0.1, grad_clip=0.5)
LAYOUTS = {
    2: {
        "cp2 ring zigzag": dict(cp=2),
        "cp2 ring contiguous": dict(cp=2, cp_split="contiguous"),
        "cp2 ulysses": dict(cp=2, cp_style="ulysses"),
        "cp2 recompute": dict(cp=2, recompute="full"),
    },
    4: {
        "cp4 ring zigzag": dict(cp=4),
        "cp4 ring contiguous": dict(cp=4, cp_split="contiguous"),
        "cp4 ulysses": dict(cp=4, cp_style="ulysses"),
        "cp2 tp2 sp": dict(cp=2, tp=2, sequence_parallel=True),
        "cp2 tp2 ulysses": dict(cp=2, tp=2, cp_style="ulysses"),
        "cp2 tp2 ulysses sp": dict(cp=2, tp=2, cp_style="ulysses", sequence_parallel=True),
        "cp2 dp2 zero2": dict(cp=2, dp=2, zero=2),
        "cp2 dp2": dict(cp=2, dp=2),
        "cp2 dp2 zero3": dict(cp=2, dp=2, zero=3),
        "cp2 pp2": dict(cp=2, pp=2, microbatches=2),
    },
}


def batches():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, CONFIG["vocab_size"], (STEPS, BATCH, CONFIG["n_positions"] + 1), generator=g
    )
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train(layout: dict) -> dict:
    """The losses of STEPS AdamW steps (clipped, decayed) of `layout` (one process: {}), then
    the global gradient norm of each step: AdamW and clipping hide a gradient's scale from the
    losses, so a missing average over cp shows only there. With cp, what the AttentionMeter
    saw."""
    from hplab import training
    from hplab.config import Layout, OptimConfig
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.observe.observers import AttentionMeter
    from hplab.parallel.compose import parallelize
    from hplab.parallel.mesh import Mesh
    from hplab.parallel.optim import stepped_groups
    from hplab.training import TrainState, build_lr_scheduler, build_optimizer, train_step

    mesh = Mesh(
        pp=layout.get("pp", 1),
        dp=layout.get("dp", 1),
        cp=layout.get("cp", 1),
        tp=layout.get("tp", 1),
    )
    c = Layout(**layout)
    optim = OptimConfig(**TRAINING)
    model = parallelize(build_model(GPTConfig(**CONFIG), 0), mesh, c)
    optimizer = build_optimizer(model, mesh, c, optim)
    par = TrainState(model, optimizer, build_lr_scheduler(optimizer, optim), mesh, c, optim)
    share = BATCH // mesh.dp_size
    mine = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
    meter = AttentionMeter(par.decoder, mesh.cp, c.cp_style, c.cp_split) if c.cp > 1 else None
    norms, clip, losses = [], training.clip_grad_norm_, []
    training.clip_grad_norm_ = lambda *args: norms.append(clip(*args)) or norms[-1]
    try:
        for x, y in batches():
            with meter.step() if meter else contextlib.nullcontext():
                losses.append(train_step(par, x[mine], y[mine]))
    finally:
        training.clip_grad_norm_ = clip
    stepped = sum(t.numel() for g in stepped_groups(par.optimizer) for t in g["params"])
    whole = sum(p.numel() for p in build_model(GPTConfig(**CONFIG), 0).parameters())
    return {"losses": losses + norms, "meter": meter and meter.per_step, "share": stepped / whole}


def worker():
    return {
        "attention": attention_worker(),
        "losses": {name: train(layout) for name, layout in LAYOUTS[dist_size()].items()},
    }


def dist_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def gathered(results: list[dict], key, name):
    return cp.join_tokens([r[key][name] for r in results], key[1], dim=2)


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    results = run_distributed(worker, request.param)
    losses = {name: run["losses"] for name, run in results[0]["losses"].items()}
    meters = {name: [r["losses"][name]["meter"] for r in results] for name in losses}
    shares = {name: [r["losses"][name]["share"] for r in results] for name in losses}
    return request.param, [r["attention"] for r in results], losses, meters, shares


def test_every_layout_trains_the_model_one_process_trains(world):
    reference = run_distributed(train, 1, {})[0]["losses"]
    for name, losses in world[2].items():
        torch.testing.assert_close(losses, reference, rtol=RTOL, atol=0, msg=name)


def test_zero_shards_over_the_dp_and_cp_ranks_that_hold_the_same_weights(world):
    """Context parallel's ranks hold the same weights as data parallel's: ZeRO-2 and ZeRO-3
    shard them over all dp × cp = 4 ranks (as Megatron and torchtitan do), so each rank steps a
    quarter of the model (plus padding to a multiple of 4), not dp's half."""
    if world[0] != 4:
        pytest.skip("the sharded layouts run on 4 ranks")
    for name in ("cp2 dp2 zero2", "cp2 dp2 zero3"):
        assert all(0.25 <= share < 0.2525 for share in world[4][name]), (name, world[4][name])
    assert world[4]["cp2 dp2"] == [1.0] * 4  # (no ZeRO: every rank steps the whole model)


@pytest.mark.parametrize(
    "key",
    [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "zigzag"), ("ulysses", "contiguous")],
)
def test_attention_equals_sdpa_on_the_whole_sequence(world, key):
    _, results, *_ = world
    ref = reference()
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(
            gathered(results, key, name),
            ref[name],
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m: f"{key} {name}: {m}",
        )


def test_ring_bytes_per_step_match_the_formula(world):
    """formulas.ring_attention_bytes: forward N-1 K/V blocks, backward N-1 K/V blocks and N
    dK/dV blocks, each 2·b·(s/N)·h fp32 numbers; every send has its recv."""
    n, results, *_ = world
    want = ring_attention_bytes(B, SEQ, HEADS * D, n)
    for split in ("contiguous", "zigzag"):
        for r in results:
            fwd, both = r["ring", split]["forward"], r["ring", split]["all"]
            assert (fwd["send"]["calls"], fwd["send"]["bytes"]) == (n - 1, want["forward"])
            assert both["send"]["bytes"] == want["forward"] + want["backward"]
            assert both["recv"]["bytes"] == both["send"]["bytes"]
            assert both["send"]["calls"] == 3 * n - 2


def test_the_ring_sends_in_the_inputs_dtype(world):
    """In bf16 the K/V blocks and the dK/dV accumulators travel as bf16: half the fp32 bytes
    (the math runs in fp32); the result is within bf16's rounding of the fp32 one."""
    n, results, *_ = world
    want = ring_attention_bytes(B, SEQ, HEADS * D, n, elem_bytes=2)
    for r in results:
        sent = r["ring", "zigzag", "bf16"]["all"]["send"]["bytes"]
        assert sent == want["forward"] + want["backward"]
        assert {r["ring", "zigzag", "bf16"][t].dtype for t in ("out", "dq", "dk", "dv")} == {
            torch.bfloat16
        }
    ref = reference(torch.bfloat16)
    for name in ("out", "dq", "dk", "dv"):  # a few bf16 roundings (2^-8 each) of O(1) values
        got = gathered(results, ("ring", "zigzag", "bf16"), name).float()
        torch.testing.assert_close(
            got, ref[name], rtol=2**-6, atol=2**-6, msg=lambda m: f"bf16 {name}: {m}"
        )


def test_ulysses_moves_four_all_to_alls(world):
    """q, k, v in one all-to-all, the output in another; the same two backward."""
    n, results, *_ = world
    for r in results:
        ops = r["ulysses", "zigzag"]["all"]
        assert ops["all_to_all"]["calls"] == 4
        assert ops["all_to_all"]["bytes"] == 8 * B * HEADS * (SEQ // n) * D * 4
        assert "send" not in ops


def test_the_meter_counts_each_ranks_attention_work(world):
    """Per step: b·heads·layers × the pairs each rank attends, seconds ≥ blocked ≥ 0."""
    (n, _, _, meters, _), seq = world, CONFIG["n_positions"]
    per_rank = BATCH * CONFIG["n_head"] * CONFIG["n_layer"]
    for name, split, style in (
        (f"cp{n} ring contiguous", "contiguous", "ring"),
        (f"cp{n} ring zigzag", "zigzag", "ring"),
        (f"cp{n} ulysses", "zigzag", "ulysses"),
    ):
        want = (
            [per_rank * cp.pairs_computed(r, n, split, seq // n) for r in range(n)]
            if style == "ring"
            else [per_rank * seq * (seq + 1) // 2 // n] * n
        )
        assert [m["attention_pairs"] for m in meters[name]] == [[p] * STEPS for p in want]
        for m in meters[name]:
            assert all(s >= b >= 0 for s, b in zip(m["attention_s"], m["attention_blocked_s"]))


def test_zigzag_evens_the_causal_work():
    """Pairs of a 16-token sequence: contiguous over 4 ranks is 10, 26, 42, 58 (the diagonal
    n(n+1)/2 plus r full n² blocks); zig-zag gives every rank 10 + 3·8 = 34; both sum to
    s(s+1)/2 = 136."""
    contiguous = [cp.pairs_computed(r, 4, "contiguous", 4) for r in range(4)]
    zigzag = [cp.pairs_computed(r, 4, "zigzag", 4) for r in range(4)]
    assert contiguous == [10, 26, 42, 58] and zigzag == [34] * 4
    assert sum(contiguous) == sum(zigzag) == 16 * 17 // 2


def test_the_blocks_of_scores_each_rank_computes_match_the_formula():
    """Counting the scores of every block the ring computes (a diagonal one whole, as a CPU
    computes it before the mask): contiguous rank r computes r + 1 blocks of (s/N)², every
    zig-zag rank (N + 1)/2."""
    n = 8  # tokens per rank
    for size in (2, 3, 4, 8):
        for split in ("contiguous", "zigzag"):
            for rank in range(size):
                works = [cp.block_work(rank, src, size, split, n) for src in range(size)]
                scores = sum(len(range(n)[w[0]]) * len(range(n)[w[1]]) for w in works if w)
                assert scores / n**2 == formulas.ring_attention_blocks(rank, size, split)


def test_split_and_inverse():
    x = torch.arange(16).view(1, 16)
    assert cp.positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    assert cp.positions(16, 1, 4, "contiguous").tolist() == [4, 5, 6, 7]
    for split in CP_SPLITS:
        assert torch.equal(
            cp.join_tokens([cp.tokens_of(x, r, 4, split) for r in range(4)], split), x
        )


def test_layouts_that_do_not_split_are_refused_in_one_sentence():
    from hplab.config import LayoutError, check_context_parallel

    with pytest.raises(LayoutError, match="multiple of 8"):
        check_context_parallel(12, 4, 4, "ring", "zigzag")
    with pytest.raises(LayoutError, match="divides 6"):
        check_context_parallel(16, 6, 4, "ulysses", "contiguous")
    check_context_parallel(12, 6, 4, "ring", "contiguous")


def test_the_mesh_puts_cp_between_tp_and_dp():
    """Megatron's order: tp innermost, then cp, then dp, then pp (8 ranks, dp2 × cp2 × tp2)."""
    from hplab.config import Layout, LayoutError, check_mesh
    from hplab.parallel.mesh import group_ranks, replicas_with_context_parallel

    groups = group_ranks(dp=2, tp=2, pp=1, cp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # the ranks that hold the same weights: gradients average and ZeRO shards over them
    assert replicas_with_context_parallel(2, 2, 1, 2) == {"dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]]}
    experts = replicas_with_context_parallel(dp=4, tp=1, pp=1, cp=2, ep=2)["edp_cp"]
    assert experts == [[0, 1, 4, 5], [2, 3, 6, 7]]  # dp ranks {0, 2} and {1, 3}, both cp ranks
    with pytest.raises(
        LayoutError,
        match=r"dp=1 × tp=2 × pp=1 × cp=3 = 6 processes, but "
        r"there are 4: make --dp × --tp × --pp × --cp",
    ):
        check_mesh(Layout(dp=1, tp=2, pp=1, cp=3), 4)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--nproc", "4", "--cp", "4", "--seq-len", "20"],
            "cuts the 20-token sequence into 8 "
            "chunks for 4 context-parallel ranks: make the sequence length a multiple of 8",
        ),
        (
            ["--nproc", "2", "--cp", "2", "--cp-split", "contiguous", "--seq-len", "15"],
            "multiple of 2",
        ),
        (
            [
                "--nproc",
                "4",
                "--cp",
                "4",
                "--cp-style",
                "ulysses",
                "--n-head",
                "2",
                "--n-embd",
                "32",
            ],
            "(of each tensor-parallel rank: 2) over 4 context",
        ),
        (
            [
                "--nproc",
                "4",
                "--cp",
                "2",
                "--tp",
                "2",
                "--cp-style",
                "ulysses",
                "--n-head",
                "2",
                "--n-embd",
                "32",
            ],
            "(of each tensor-parallel rank: 1) over 2 context",
        ),
        (["--nproc", "4", "--cp", "3"], "cannot be split into tp=1 × pp=1 × cp=3"),
        (  # sequence parallel splits each cp rank's 6 tokens over 4 tp ranks: not whole
            "--nproc 8 --cp 2 --tp 4 --sequence-parallel --seq-len 12".split(),
            "over 4 tensor-parallel ranks × 2 context-parallel: make the sequence length a "
            "multiple of 8 (tp × cp)",
        ),
    ],
)
def test_bad_context_parallel_command_lines_fail_in_one_line(capsys, monkeypatch, flags, says):
    """Refused by train.py's checks, before any process starts."""
    from hplab.train import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    code, err = main([*flags, "--steps", "1"]), capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("hplab: error:") and says in err, err
