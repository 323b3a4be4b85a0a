"""The planner against published numbers, and the rules of thumb that should fall out of it.

Each test states its source and its tolerance. Run `pytest tests/test_plan.py -s` to see the
comparison tables printed.
"""

import json
import subprocess
import sys
from dataclasses import fields, replace

import pytest

from hplab import plan as P
from hplab.plan.search_layouts import _best, _neighbours

GIB = 2**30


# --- ZeRO paper, Table 1: per-device model-state memory of a 7.5B model, K = 12 -------------
# Rajbhandari et al. 2020. Columns: baseline DDP, P_os, P_os+g, P_os+g+p, in GB (1e9 bytes),
# printed to one decimal (two for the smallest values): we compare to the printed precision.
ZERO_TABLE_1 = {
    1: (120, 120, 120, 120),
    4: (120, 52.5, 41.3, 30),
    16: (120, 35.6, 21.6, 7.5),
    64: (120, 31.4, 16.6, 1.88),
    256: (120, 30.4, 15.4, 0.47),
    1024: (120, 30.1, 15.1, 0.12),
}


@pytest.mark.parametrize("dp", sorted(ZERO_TABLE_1))
def test_zero_paper_table1_7_5b(dp):
    print(f"\nZeRO Table 1, Ψ=7.5B, N_d={dp}: published vs planner (GB)")
    for stage, published in enumerate(ZERO_TABLE_1[dp]):
        got = P.model_state_bytes(7.5e9, dp, stage, "bf16")["total_bytes"] / 1e9
        decimals = 2 if published < 1 else 1
        print(f"  stage {stage}: {published:>7} vs {got:.4f}")
        assert abs(got - published) <= 10**-decimals / 2 + 1e-9  # agrees to the printed digits


def test_model_state_kinds_follow_the_contract():
    psi = 1000
    fp32 = P.model_state_bytes(psi, 1, 0, "fp32")
    assert (
        fp32["params_bytes"],
        fp32["grads_bytes"],
        fp32["optim_bytes"],
        fp32["master_bytes"],
    ) == (4000, 4000, 8000, 0)
    mixed = P.model_state_bytes(psi, 4, 2, "bf16")
    assert (
        mixed["params_bytes"],
        mixed["grads_bytes"],
        mixed["optim_bytes"],
        mixed["master_bytes"],
    ) == (2000, 500, 2000, 1000)
    padded = P.model_state_bytes(1001, 4, 3, "fp32", padded=True)
    assert padded["params_bytes"] == 4 * 251  # ceil(1001 / 4) elements per shard
    off = P.model_state_bytes(psi, 4, 1, "bf16", offload=True)
    assert off["optim_bytes"] == off["master_bytes"] == 0 and off["cpu_bytes"] == 3000


def test_gpt2_parameter_count_is_exact():
    # Ψ = V·h + S·h + L·(12h² + 13h) + 2h; GPT-2 small has 124,439,808 parameters (HF count)
    gpt2 = P.ModelConfig(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    assert gpt2.num_params() == 124_439_808
    # tensor and pipeline parallel split them without losing any (tied head counted once)
    stage = P.params_per_stage(gpt2, tp=1, pp=1)
    assert stage["first"] == gpt2.num_params()


# --- Megatron-LM 2021 (Narayanan et al., SC21), Table 1 ------------------------------------
# (preset, tp, pp, GPUs, published achieved TFLOP/s per GPU). A100 80GB, 8 per node, fp16,
# full activation recompute, no ZeRO. The planner picks micro-batch size and 1F1B/interleaved
# for the published (tp, pp, dp). Its two compute-efficiency defaults were set once against
# this table; the test checks that one setting fits all ten rows.
MEGATRON_TABLE_1 = [
    ("megatron-1.7b", 1.7, 1, 1, 32, 137),
    ("megatron-3.6b", 3.6, 2, 1, 64, 138),
    ("megatron-7.5b", 7.5, 4, 1, 128, 142),
    ("megatron-18b", 18.4, 8, 1, 256, 135),
    ("megatron-39b", 39.1, 8, 2, 512, 138),
    ("megatron-76b", 76.1, 8, 4, 1024, 140),
    ("megatron-146b", 145.6, 8, 8, 1536, 148),
    ("megatron-310b", 310.1, 8, 16, 1920, 155),
    ("megatron-530b", 529.6, 8, 35, 2520, 163),
    ("megatron-1t", 1008.0, 8, 64, 3072, 163),
]
TFLOPS_TOLERANCE = 0.10  # every row within ±10 %
TFLOPS_MEAN_TOLERANCE = 0.04  # and the mean absolute error within 4 %


def test_megatron_2021_table1_tflops():
    cluster = P.Cluster(P.GPU_PRESETS["a100-80g"], gpus_per_node=8)
    errors = []
    print("\nMegatron-LM 2021 Table 1: achieved TFLOP/s per GPU, published vs planner")
    for name, billions, tp, pp, gpus, published in MEGATRON_TABLE_1:
        model = P.MEGATRON_2021_PRESETS[name]
        assert model.num_params() / 1e9 == pytest.approx(billions, rel=0.03)
        res = P.search(
            model,
            gpus,
            cluster,
            precision="fp16",
            fixed=dict(
                tp=tp,
                pp=pp,
                zero=0,
                recompute="full",
                sequence_parallel=False,
                schedule=("1f1b", "interleaved"),
            ),
        )
        got = res["winner"]["tflops_per_gpu"]
        err = got / published - 1
        errors.append(err)
        print(
            f"  {billions:7.1f}B tp{tp} pp{pp:<3} {gpus:5d} GPUs: {published} vs {got:6.1f} "
            f"({err:+.1%})  {res['winner']['layout']}"
        )
        assert abs(err) <= TFLOPS_TOLERANCE, name
    assert sum(abs(e) for e in errors) / len(errors) <= TFLOPS_MEAN_TOLERANCE


def test_flops_formulas_match_the_paper_closed_forms():
    # [PTD-P] Eq. 3 with recompute, and the 72-coefficient form without
    m = P.GPT3_PRESETS["gpt3-175b"]
    B, s, h, L, V = 1536, m.seq_len, m.n_embd, m.n_layer, m.vocab_size
    f = P.flops_per_step(m, B, "full")
    assert f["hardware_flops"] == pytest.approx(
        96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    )
    f = P.flops_per_step(m, B, "none")
    assert f["model_flops"] == pytest.approx(
        72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    )
    assert f["hardware_flops"] == f["model_flops"]


# --- Korthikanti et al. 2022: activation memory per layer, Table 2, for the Table 3 models ---
KORTHIKANTI_MODELS = [  # (name, heads a, hidden h, layers L, tensor parallel t); s = 2048
    ("22B", 64, 6144, 48, 8),
    ("175B", 96, 12288, 96, 8),
    ("530B", 128, 20480, 105, 8),
    ("1T", 160, 25600, 128, 8),
]


@pytest.mark.parametrize(("name", "a", "h", "L", "t"), KORTHIKANTI_MODELS)
def test_activation_per_layer_matches_table2(name, a, h, L, t):
    s, b = 2048, 1
    sbh = s * b * h
    paper = {  # Table 2, bytes per layer, 16-bit activations with dropout
        ("none", False, 1): sbh * (34 + 5 * a * s / h),
        ("none", False, t): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", True, t): sbh / t * (34 + 5 * a * s / h),
        ("selective", False, t): sbh * (10 + 24 / t),
        ("selective", True, t): sbh / t * 34,
        ("full", False, t): 2 * sbh,
        ("full", True, t): 2 * sbh / t,
    }
    for (rc, sp, tt), expected in paper.items():
        got = P.activation_bytes_per_layer(s, b, h, a, tt, sp, rc, act_bytes=2, dropout=True)
        assert got == pytest.approx(expected), (name, rc, sp, tt)


def test_activation_worked_numbers_for_gpt3():
    # Sec. 4.2: for GPT-3 175B, 5as/h = 80, so attention scores dominate; sequence parallel with
    # selective recompute cuts the per-layer activations of tensor parallel (t = 8) about 5×.
    s, h, a, t = 2048, 12288, 96, 8
    assert 5 * a * s / h == 80
    tp_only = P.activation_bytes_per_layer(s, 1, h, a, t, False, "none")
    sp_selective = P.activation_bytes_per_layer(s, 1, h, a, t, True, "selective")
    print(
        f"\nGPT-3 175B, t=8, b=1: {tp_only / 1e6:.0f} MB → {sp_selective / 1e6:.0f} MB per layer "
        f"({tp_only / sp_selective:.1f}×)"
    )
    assert 5 <= tp_only / sp_selective <= 5.5


def test_pipeline_first_stage_holds_the_whole_model_in_1f1b():
    # [SP] Sec. 4.2.3: with 1F1B the first stage keeps p microbatches of L/p layers = L layers;
    # the interleaved schedule multiplies that by 1 + (p−1)/(p·v).
    m = P.GPT3_PRESETS["gpt3-175b"]
    base = P.Layout(
        dp=1,
        tp=8,
        pp=8,
        microbatches=64,
        batch_size=64,
        precision="bf16",
        sequence_parallel=True,
        recompute="selective",
    )
    per_layer = P.activation_bytes_per_layer(2048, 1, 12288, 96, 8, True, "selective")
    embed = 2048 * 12288 / 8  # embedding dropout mask, one per microbatch in flight
    first = P.activation_memory(m, base)["first_stage_bytes"]
    assert first == pytest.approx(m.n_layer * per_layer + 8 * embed)
    inter = P.activation_memory(m, replace(base, schedule="interleaved", virtual_stages=4))
    assert inter["first_stage_bytes"] == pytest.approx(
        (m.n_layer * per_layer + 8 * embed) * (1 + 7 / (8 * 4))
    )


def test_bubble_and_ring_formulas():
    # the planner's bubble is the ratio idle / compute, (p−1)/m ([PTD-P] Sec. 2.2)
    assert P.bubble_ratio("1f1b", 8, 32) == pytest.approx(7 / 32)
    assert P.bubble_ratio("interleaved", 8, 32, 4) == pytest.approx(7 / 128)
    assert P.bubble_ratio("zb-h1", 8, 32) == pytest.approx(7 / 96)
    # ring all-reduce moves 2(n−1)/n of the buffer per rank (nccl-tests "bus bytes")
    assert P.collective_time_s("all_reduce", 8e9, 8, 1e9, 0.0) == pytest.approx(2 * 7 / 8 * 8)
    assert P.collective_time_s("all_gather", 8e9, 8, 1e9, 1e-6) == pytest.approx(7 / 8 * 8 + 7e-6)
    assert P.collective_time_s("all_reduce", 8e9, 1, 1e9, 1e-6) == 0.0  # one rank sends nothing


# --- rules of thumb from the seeds, which should fall out of the model ----------------------


def _search(model, gpus, **kw):
    cluster = P.Cluster(
        P.GPU_PRESETS[kw.pop("gpu", "a100-80g")], 8, inter_node_gbps=kw.pop("inter_bw", None)
    )
    return P.search(
        P.model_presets()[model] if model in ("gpt2",) else P.GPT3_PRESETS[model],
        gpus,
        cluster,
        **kw,
    )


def test_one_node_model_fits_one_gpu_plain_ddp():
    # seed 004: single node, model fits on one GPU → DDP (ZeRO may help memory, not speed)
    w = _search("gpt2", 8, batch_size=64)["winner"]
    assert (w["tp"], w["pp"], w["zero"]) == (1, 1, 0)


def test_one_node_model_too_big_for_one_gpu_needs_sharding():
    # seed 004: single node, model does not fit → PP, ZeRO or TP; plain DDP does not fit
    res = _search("gpt3-13b", 8, gpu="a100-40g")
    ddp = [p for p in res["_all"] if p["tp"] == p["pp"] == 1 and p["zero"] == 0]
    assert ddp and not any(p["fits"] for p in ddp)
    w = res["winner"]
    assert w["tp"] > 1 or w["pp"] > 1 or w["zero"] > 0


def test_many_nodes_fast_links_175b_uses_tp_in_node_plus_pp_plus_dp():
    # seed 004: many nodes with fast links → ZeRO, or PP + TP + DP; TP stays inside a node
    w = _search("gpt3-175b", 1024)["winner"]
    assert w["tp"] > 1 and w["pp"] > 1 and w["dp"] > 1
    assert w["tp"] <= 8 and not w["tp_crosses_nodes"]
    assert w["zero"] <= 1


def test_many_nodes_fast_links_mid_size_model_uses_zero_data_parallel():
    w = _search("gpt3-6.7b", 64)["winner"]
    assert (w["tp"], w["pp"]) == (1, 1) and w["zero"] >= 1


def test_slow_inter_node_links_keep_zero_at_stage_1():
    # seed 004: slow links between nodes → DP + TP + PP + ZeRO-1: stages 2 and 3 send
    # parameters or gradients every microbatch, which the slow network cannot afford
    res = _search("gpt3-13b", 64, inter_bw=3)
    w = res["winner"]
    assert w["zero"] <= 1 and not w["tp_crosses_nodes"]
    for stage in (2, 3):
        alt = _best(_neighbours(w, res["_all"], "zero", stage))
        assert alt["step_time_s"] > 1.5 * w["step_time_s"]


# --- the command line ----------------------------------------------------------------------


def test_cli_json_has_the_headline_fields(capsys):
    P.main(
        [
            "--model",
            "gpt3-175b",
            "--dp",
            "16",
            "--tp",
            "8",
            "--pp",
            "8",
            "--zero",
            "1",
            "--recompute",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    for key in (
        "model_state_bytes_per_gpu",
        "activation_bytes_per_gpu",
        "memory_bytes_per_gpu",
        "step_time_s",
        "tflops_per_gpu",
        "mfu",
    ):
        assert out[key] > 0
    assert out["params_bytes"] + out["grads_bytes"] + out["optim_bytes"] + out[
        "master_bytes"
    ] == pytest.approx(out["model_state_bytes_per_gpu"])


def test_cli_params_alone(capsys):
    P.main(["--params", "7.5e9", "--dp", "64", "--zero", "2", "--precision", "bf16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["model_state_bytes_per_gpu"] / 1e9 == pytest.approx(16.640625)


def test_cli_text_report_and_search(capsys):
    P.main(["--model", "gpt2", "--dp", "4", "--tp", "2", "--zero", "1", "--precision", "bf16"])
    text = capsys.readouterr().out
    assert "memory per GPU" in text and "time per step" in text and "MFU" in text
    P.main(["--model", "gpt3-1.3b", "--search", "--gpus", "8", "--top", "3"])
    text = capsys.readouterr().out
    assert "winner:" in text and "best of each family" in text


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "tiny", "--tp", "3"], "do not split over 3 tensor-parallel ranks"),
        (["--model", "tiny", "--dp", "2", "--gpus", "3"], "dp×cp×tp×pp"),
        (["--model", "gpt2", "--cp", "5"], "a multiple of 10"),
        (["--model", "gpt2", "--cp", "8", "--cp-style", "ulysses"], "rank: 12) over 8 context"),
        (["--model", "gpt2", "--moe-experts", "8", "--dp", "8", "--ep", "3"], "must divide"),
        (["--model", "gpt2", "--moe-experts", "8", "--dp", "2", "--ep", "4"], "--dp (2)"),
        (["--model", "gpt2", "--dp", "2", "--ep", "2"], "and this model has none"),
        (["--model", "gpt2", "--moe-experts", "4", "--moe-top-k", "5"], "number of experts, 4"),
        (["--model", "gpt2", "--cp", "0"], "at least 1"),
        (["--model", "gpt2", "--n-layer", "0"], "positive"),
        (["--model", "tiny", "--dp", "3", "--batch-size", "8"], "does not split over dp=3"),
        (["--model", "no-such-model"], "unknown model"),
        (["--model", "gpt2", "--search"], "--gpus"),
        (["--zero", "5"], "--zero"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        P.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_cli_layout_flags_are_the_one_layouts(capsys):
    # the planner's layout flags come from config.Layout (flags.add_flags), as train.py's do
    dests = {action.dest for action in P.build_parser()._actions}
    assert {f.name for f in fields(P.Layout)} - dests == {"bucket_mb", "prefetch"}  # (not modelled)
    modes = {}
    for flags in (
        [],
        ["--recompute"],
        ["--recompute", "selective"],
        ["--selective-recompute"],
        ["--recompute", "--selective-recompute"],
    ):
        P.main(["--model", "tiny", "--json", *flags])
        modes[" ".join(flags)] = json.loads(capsys.readouterr().out)["recompute"]
    assert list(modes.values()) == ["none", "full", "selective", "selective", "full"]


def test_module_runs_and_imports_no_torch():
    code = "import sys, hplab.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    run = subprocess.run(
        [sys.executable, "-m", "hplab.plan", "--model", "gpt3-1.3b", "--tp", "3"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1


# --- context parallel and experts (issue 12): hand-computed cases -----------------------------
# A toy MoE GPT: L=2, h=8, 2 heads, S=16, V=32, E=4 experts, top-2. Dense GPT-2 would have
# Ψ = 32·8 + 16·8 + 2·(12·64 + 13·8) + 2·8 = 2144; one MLP is 8·64 + 5·8 = 552 parameters.
MOE = P.ModelConfig(
    vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2, n_experts=4, name="toy-moe"
)


def test_moe_parameters_split_into_dense_and_experts():
    experts, dense = 2 * 4 * 552, 2144 - 2 * 552 + 2 * 8 * 4  # E MLPs per block; router h·E
    assert (MOE.num_params(), experts + dense) == (5520, 5520)
    whole = P.params_per_stage(MOE)
    assert (whole["first"], whole["experts"]) == (dense, experts)
    # tp=2 halves each expert's matrices and column bias (8h² + 4h), keeps its row bias h
    assert P.params_per_stage(MOE, tp=2, ep=2)["experts"] == 2 * (4 // 2) * ((512 + 32) / 2 + 8)
    lay = P.Layout(dp=4, ep=2, zero=1, batch_size=4)
    got = P.plan(MOE, lay)  # fp32: params and Adam's two moments
    assert got["params_bytes"] == 4 * (dense + experts / 2)  # experts ÷ ep, dense whole
    # ZeRO-1 shards the dense optimizer state over dp=4, the experts' over their 2 replicas
    assert got["optim_bytes"] == 8 * (dense / 4 + experts / 2 / 2)


def test_moe_flops_count_only_the_top_k_experts():
    B, s, h, L, E, k = 3, MOE.seq_len, MOE.n_embd, MOE.n_layer, 4, 2
    dense = P.flops_per_step(replace(MOE, n_experts=0), B)["model_flops"]
    extra = 3 * L * B * s * (16 * h * h * (k - 1) + 2 * h * E)  # k MLPs instead of 1, router
    assert P.flops_per_step(MOE, B)["model_flops"] == dense + extra


def test_context_parallel_divides_activations_and_compute_by_cp():
    tiny = P.model_presets()["tiny"]  # flash attention: every saved tensor grows with s
    one, four = (P.plan(tiny, P.Layout(cp=cp, batch_size=2)) for cp in (1, 4))
    head_major = 4 * 2 * 64 // 4 * 64 * 4  # hplab's attention output, beside its copy, per layer
    assert four["activation_bytes_per_gpu"] == pytest.approx(
        one["activation_bytes_per_gpu"] / 4 + head_major
    )
    assert four["gemm_s"] == pytest.approx(one["gemm_s"] / 4)  # each rank's tokens' FLOPs
    assert four["params_bytes"] == one["params_bytes"]  # every cp rank holds all weights
    gpt3 = P.GPT3_PRESETS["gpt3-1.3b"]  # stores s×s scores, which ring attention never does
    ring = P.activation_memory(gpt3, P.Layout(cp=2, batch_size=8))["per_layer_bytes"]
    assert (
        ring
        == P.activation_bytes_per_layer(
            1024, 8, 2048, 16, act_bytes=4, dropout=True, flash_attention=True
        )
        + 1024 * 8 * 2048 * 4
    )


@pytest.mark.parametrize(
    ("style", "recompute", "blocks"),
    [
        ("ring", "none", 3 * 2 - 2),
        ("ring", "full", 4 * 2 - 3),  # K/V fwd (twice), K/V + dK/dV
        ("ulysses", "none", 4),
        ("ulysses", "full", 6),
    ],
)  # q,k,v + output (3 + 1 = 2 blocks) each way
def test_context_parallel_traffic_per_step(style, recompute, blocks):
    tiny = P.model_presets()["tiny"]  # L=4, h=64, s=64; b=2 per rank, fp32, cp=2, tp=2
    got = P.plan(tiny, P.Layout(tp=2, cp=2, cp_style=style, batch_size=2, recompute=recompute))
    block = 2 * 2 * (64 // 2) * (64 // 2) * 4  # K and V of this rank's tokens, its heads
    assert got["cp_bytes_per_step"] == 4 * blocks * block
    assert got["cp_comm_s"] > 0 and P.plan(tiny, P.Layout(batch_size=2))["cp_comm_s"] == 0
    assert P.ulysses_bytes(2, 64, 32, 2) == {"forward": 2 * block, "backward": 2 * block}


def test_expert_all_to_all_bytes_per_step():
    lay = P.Layout(dp=4, ep=4, batch_size=8)  # b = 2 sequences of 16 tokens per rank, fp32
    slots, layers = 2 * 16 * 2, 2  # tokens × top-k
    per_layer = 8 * 4 + 4 * slots * 8 * 4  # counts (E int64); dispatch + combine, fwd + bwd
    got = P.plan(MOE, lay)
    assert got["ep_all_to_all_bytes_per_step"] == layers * per_layer
    assert P.plan(MOE, replace(lay, recompute="full"))["ep_all_to_all_bytes_per_step"] == layers * (
        per_layer + 8 * 4 + 2 * slots * 8 * 4
    )  # the forward's exchanges again
    # seconds: bus factor (ep-1)/ep of the bytes over β, (ep-1) latency steps per all-to-all
    bw, alpha, _ = P.group_link(P.Cluster(P.GPU_PRESETS["a100-80g"]), 4, 1, P.Efficiency())
    assert got["ep_comm_s"] == pytest.approx(
        3 / 4 * layers * per_layer / bw + layers * 5 * 3 * alpha
    )
    assert P.plan(MOE, replace(lay, ep=1))["ep_all_to_all_bytes_per_step"] == 0


def test_cli_shows_context_and_expert_parallel(capsys):
    P.main(["--model", "gpt2", "--moe-experts", "8", "--dp", "4", "--ep", "4", "--cp", "2"])
    text = capsys.readouterr().out
    for needle in (
        "8 experts, top-2",
        "cp2",
        "ep4",
        "context-parallel comm",
        "expert all-to-all",
        "cp group: each GPU sends",
        "ep group: each GPU sends",
    ):
        assert needle in text, needle


def test_young_s_interval_is_where_goodput_peaks():
    """√(2·C·M) maximises τ/(τ+C)·(1 − (R + (τ+C)/2)/M) to first order: on a fine grid the best
    interval lies within 5% of it (C/M is not 0: Daly's correction) and its goodput within
    0.01 points of the peak (C = 30 s, R = 60 s, Llama 3's 16,384 GPUs)."""
    from hplab.plan import reliability as R

    mtbf = R.cluster_mtbf_s(16384)
    assert mtbf / 3600 == pytest.approx(54 * 24 / 419)  # 419 failures in 54 days
    best = R.young_interval_s(30, mtbf)
    grid = [best * (0.5 + i / 1000) for i in range(1001)]
    peak = max(grid, key=lambda t: R.goodput(t, 30, 60, mtbf))
    assert peak == pytest.approx(best, rel=0.05)
    assert R.goodput(best, 30, 60, mtbf) > R.goodput(peak, 30, 60, mtbf) - 1e-4
    plan = R.checkpoint_plan(16384, 30, 60)
    assert plan["goodput"] == max(row["goodput"] for row in plan["by_interval"])
    assert 0.9 < plan["goodput"] < 0.95
    assert R.goodput(1e9, 30, 60, mtbf) == 0.0  # never saving: failures eat everything


def test_cli_gives_the_checkpoint_interval(capsys):
    assert P.main(["--gpus", "16384", "--checkpoint-seconds", "30"]) == 0
    text = capsys.readouterr().out
    assert "the cluster fails every 3.09 h" in text
    assert "save every √(2·C·MTBF) = 13.6 min of training (Young): goodput 92.3%" in text
    for bad, says in (
        (["--checkpoint-seconds", "30"], "--checkpoint-seconds needs --gpus N"),
        (["--gpus", "8", "--checkpoint-seconds", "inf"], "must be a positive, finite float"),
        (["--params", "inf"], "must be a positive, finite float"),
    ):
        with pytest.raises(SystemExit) as exit:
            P.main(bad)
        assert exit.value.code == 2 and says in capsys.readouterr().err


def test_a_search_over_2_to_the_40_gpus_is_one_line(capsys):
    """(Its layouts grow with the divisors of N: it would not end.)"""
    with pytest.raises(SystemExit) as exit:
        P.main(["--search", "--gpus", str(2**40), "--model", "gpt2"])
    assert exit.value.code == 2
    assert "--search ranks layouts of up to 1,048,576 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "wanted"),
    [
        ("--eff-dp-overlap", "5", "must be from 0 to 1, got 5"),
        ("--eff-dp-overlap", "nan", "must be from 0 to 1, got nan"),
        ("--eff-gemm", "50", "must be above 0 and at most 1, got 50"),
        ("--eff-gemm", "0", "must be above 0 and at most 1, got 0"),
        ("--eff-usable-memory", "7", "must be above 0 and at most 1, got 7"),
        ("--eff-comm", "inf", "must be above 0 and at most 1, got inf"),
        ("--eff-cpu-adam-params-per-s", "-1", "must be a finite number above 0, got -1"),
        ("--eff-elementwise-passes", "inf", "must be a finite number from 0, got inf"),
        ("--eff-gemm", "x", "must be a number, got 'x'"),
    ],
)
def test_an_impossible_efficiency_is_one_line(flag, value, wanted, capsys):
    """An efficiency outside what hardware can do (an MFU of 304%, negative communication time,
    601 GB usable on an 80 GB card) is refused, naming the flag and the typed value."""
    from hplab.plan.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--model", "gpt2", "--dp", "8", flag, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"hplab.plan: error: argument {flag}: {wanted}"


def test_efficiency_refuses_an_impossible_assumption_in_python_too():
    with pytest.raises(ValueError, match=r"Efficiency.gemm \(--eff-gemm\) must be above 0"):
        P.Efficiency(gemm=50)
    assert P.Efficiency(dp_overlap=0.0, tp_overlap=1.0).tp_overlap == 1.0  # the bounds hold
