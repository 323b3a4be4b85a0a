"""hplab's Llama (hplab/models/llama.py) against transformers' own, and under the strategies
that cut it so far.

The same weights give the same logits as `LlamaForCausalLM` and `Qwen2ForCausalLM` (1e-5),
tied or untied, with grouped-query attention; a checkpoint hplab saves opens in transformers,
and `--init-from` reads a folder transformers saved. Trained by train.py on one process and
under dp 2 with DDP, ZeRO 1, 2 and 3, full and selective recompute, and on 4 ranks under
tensor parallel (with sequence parallel), pipelines (1F1B, ZB-H1) and their hybrids, it gives
one process's losses (fp32, 1e-5). The layouts that do not cut it yet are one line each.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from hplab import checkpoint
from hplab.models import hf
from hplab.models.gpt import PRESETS, build_model
from hplab.plan import Layout, params_per_stage, plan
from hplab.runtime.launch import run_distributed

transformers = pytest.importorskip("transformers")

TINY = dataclasses.replace(PRESETS["llama-tiny"], n_layer=2)
VARIANTS = {
    "GQA, tied head": TINY,
    "one K/V head per query head, untied head": dataclasses.replace(
        TINY, n_kv_head=4, tie_word_embeddings=False, rope_theta=10000.0
    ),
    "Qwen2 (q, k, v biases), one K/V head": dataclasses.replace(TINY, n_kv_head=1, qkv_bias=True),
}


def tokens(config, seed=0, shape=(2, 24)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, shape, generator=g)


def theirs_from(config, state: dict):
    """transformers' model for `config`, holding hplab's weights `state` (in fp32, eval)."""
    kind = hf.architecture(config)
    model = getattr(transformers, kind)(hf.to_hf_config(config)).float().eval()
    missing, unexpected = model.load_state_dict(hf.to_hf_state_dict(state, config), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def randomized(model):
    """Every weight drawn anew (biases and norm gains too), so no zero or one hides a mix-up."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    return model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_transformers(name):
    config = VARIANTS[name]
    ours = randomized(build_model(config)).eval()
    theirs = theirs_from(config, ours.state_dict())
    x = tokens(config)
    with torch.no_grad():
        a, b = ours(x)[0], theirs(input_ids=x).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in ours.parameters()) == config.num_params()
    # the gradients too: the loss against next tokens, through both models
    y = tokens(config, seed=1)
    ours(x, y)[1].backward()
    theirs(input_ids=x, labels=None).logits.flatten(0, 1).float().log_softmax(-1).gather(
        1, y.flatten()[:, None]
    ).mean().neg().backward()
    mine = dict(ours.named_parameters())
    for n, p in theirs.named_parameters():
        torch.testing.assert_close(mine[n].grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_presets_count_their_parameters():
    for name in ("llama-tiny", "llama-125m"):
        config = PRESETS[name]
        with torch.device("meta"):
            model = build_model(config)
        assert sum(p.numel() for p in model.parameters()) == config.num_params(), name
    assert 120e6 < PRESETS["llama-125m"].num_params() < 130e6


def test_a_long_context_llama_folder_trains_at_a_shorter_seq_len(tmp_path):
    """A Llama folder with max_position_embeddings 131072 needs --seq-len to fit (the memory
    check says so), and --seq-len is then taken: RoPE has no position table to disagree with
    (it was refused again, "leave those flags out")."""
    import json

    from hplab.cli import parse_args
    from hplab.preflight import preflight

    state = {n: p.detach() for n, p in build_model(TINY).named_parameters()}
    checkpoint.save(tmp_path / "run", TINY, state, {}, {"step": 0})
    hf_config = json.loads((tmp_path / "run" / "config.json").read_text())
    del hf_config["hplab"]
    hf_config["max_position_embeddings"] = 131072
    (tmp_path / "run" / "config.json").write_text(json.dumps(hf_config))
    (tmp_path / "run" / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match="--seq-len"):
        preflight(parse_args(["--init-from", str(tmp_path / "run")]), 1)
    job = preflight(parse_args(["--init-from", str(tmp_path / "run"), "--seq-len", "64"]), 1)
    assert job.model.n_positions == 64 and job.model.n_layer == TINY.n_layer


def test_weights_the_config_has_no_place_for_are_refused(tmp_path):
    """Qwen2's q, k and v biases under a config.json that says llama were dropped in silence
    (the run then trained another model than the folder's): now one line naming them."""
    import json

    config = VARIANTS["Qwen2 (q, k, v biases), one K/V head"]
    state = {n: p.detach() for n, p in build_model(config).named_parameters()}
    checkpoint.save(tmp_path / "run", config, state, {}, {"step": 0})
    hf_config = json.loads((tmp_path / "run" / "config.json").read_text())
    del hf_config["hplab"]
    hf_config["model_type"] = "llama"
    (tmp_path / "run" / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load_pretrained(tmp_path / "run")
    assert "model has no place for: model.layers.0.self_attn." in str(err.value)
    assert "model.layers.0.self_attn.q_proj.bias" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_saved_checkpoint_opens_in_transformers_and_init_from_reads_theirs(name, tmp_path):
    config = VARIANTS[name]
    ours = randomized(build_model(config)).eval()
    state = {n: p.detach() for n, p in ours.named_parameters()}
    checkpoint.save(tmp_path / "ours", config, state, {}, {"step": 0})
    kind = getattr(transformers, hf.architecture(config))
    theirs = kind.from_pretrained(tmp_path / "ours").float().eval()
    x = tokens(config)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs(input_ids=x).logits, rtol=1e-5, atol=1e-5)
    # transformers' own folder (no hplab entry in its config.json) read back by --init-from
    randomized(theirs).save_pretrained(tmp_path / "theirs")
    loaded = checkpoint.load_pretrained(tmp_path / "theirs")
    assert dataclasses.replace(loaded["config"], name="") == dataclasses.replace(config, name=""), (
        loaded["config"]
    )
    again = build_model(loaded["config"]).eval()
    again.load_state_dict(loaded["model"])
    with torch.no_grad():
        torch.testing.assert_close(again(x)[0], theirs(input_ids=x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "says"),
    [(6, 3, "6 attention heads do not split over 4"), (12, 3, "--tp 4 and 3 K/V heads")],
)
def test_a_hugging_face_model_is_never_cut_inside_a_head(heads, kv_heads, says):
    """tp.parallelize reads transformers' num_attention_heads and num_key_value_heads too: a
    cut through a head is one sentence, before any weight is touched."""
    from hplab.config import LayoutError
    from hplab.models import llama
    from hplab.parallel import tp
    from hplab.parallel.collectives import Communicator

    config = dataclasses.replace(TINY, n_head=heads, n_kv_head=kv_heads, n_embd=16 * heads)
    model = transformers.LlamaForCausalLM(hf.to_hf_config(config))
    comm = object.__new__(Communicator)  # four ranks, as far as cutting needs to know
    comm.size, comm.rank = 4, 0
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(LayoutError, match=says):
        tp.parallelize(model, comm, llama.TP_PLAN)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_unknown_math_in_a_config_is_one_sentence(tmp_path):
    """A RoPE scaling, another activation or o_proj biases are not hplab's Llama: refused."""
    base = hf.to_hf_config(TINY).to_dict()
    for change, says in (
        ({"hidden_act": "gelu"}, "has hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "has rope_type"),
        ({"attention_bias": True}, "has attention_bias True"),
        ({"vocab_size": 1000}, "has vocab_size 1000, the vocabulary of no shipped tokenizer"),
        ({"model_type": "mistral3"}, "hplab reads gpt2, llama and qwen2 models"),
    ):
        with pytest.raises(ValueError, match=says):
            hf.config_from_hf({**base, **change})


TRAIN = ["--model", "llama-tiny", "--n-layer", "2", "--no-progress", "--steps", "3"]
TRAIN += ["--batch-size", "4", "--lr", "3e-3", "--grad-clip", "1e9"]  # (never clips)
EXPERTS = ["--moe-experts", "4", "--moe-balance", "sequence"]
RUNS = {
    4: {  # q, k, v, gate, up column parallel; o, down row parallel; the vocabulary split
        "dp2 tp2 sp zero1": "--dp 2 --tp 2 --sequence-parallel --zero 1".split(),
        "tp2 pp2 1f1b, 2 microbatches": "--tp 2 --pp 2 --microbatches 2".split(),
        "dp2 pp2 zb-h1 zero1": "--dp 2 --pp 2 --schedule zb-h1 --zero 1".split(),
        # RoPE at each token's true position; the ring carries the 2 K/V heads only
        "cp2 tp2 ring sp": "--cp 2 --tp 2 --sequence-parallel".split(),
        # 2 K/V heads over 4 tp ranks: each held by the 2 ranks whose query heads read it
        "tp4, each K/V head on 2 ranks": ["--tp", "4", "--save", "{saved}-tp4"],
        "tp4 sp, each K/V head on 2 ranks": ["--tp", "4", "--sequence-parallel"],
        "cp4 ring contiguous": "--cp 4 --cp-split contiguous".split(),
        "cp2 dp2 ulysses zero2": "--cp 2 --dp 2 --cp-style ulysses --zero 2".split(),
        # Mixtral-style: each MLP 4 SwiGLU experts, top-2 (sequence-wise balance: any cut)
        "experts: dp4 ep2 zero1": [*EXPERTS, *"--dp 4 --ep 2 --zero 1".split()],
        "experts: dp2 ep2 pp2, 2 microbatches": [
            *EXPERTS,
            *"--dp 2 --ep 2 --pp 2 --microbatches 2".split(),
        ],
        "experts: dp2 tp2 ep2 sp": [*EXPERTS, *"--dp 2 --tp 2 --ep 2 --sequence-parallel".split()],
    },
    2: {
        "dp2 (DDP)": ["--dp", "2"],
        "dp2 zero1": ["--dp", "2", "--zero", "1"],
        "dp2 zero2, 2 microbatches": ["--dp", "2", "--zero", "2", "--microbatches", "2"],
        "dp2 zero3 recompute full": ["--dp", "2", "--zero", "3", "--recompute", "full"],
        "dp2 recompute selective": ["--dp", "2", "--recompute", "selective"],
        "dp2 zero1 bf16": ["--dp", "2", "--zero", "1", "--precision", "bf16"],
        "dp2 zero3, saved at step 2": "--dp 2 --zero 3 --steps 2 --save {saved}".split(),
    },
    1: {
        "one process": ["--save", "{saved}-one"],
        "one process bf16": ["--precision", "bf16"],
        "one process, resumed at step 2": ["--resume", "{saved}"],
        "experts: one process": EXPERTS,
    },
}
FP32 = [n for n in [*RUNS[4], *RUNS[2]] if not any(w in n for w in ("bf16", "saved", "experts"))]


def _hugging_face_models_under_tensor_parallel() -> dict:
    """transformers' own LlamaForCausalLM and Qwen2ForCausalLM, cut by `llama.TP_PLAN` over the
    whole world (group None), and MixtralForCausalLM by `llama.ATTENTION_TP_PLAN`, trained 3
    AdamW steps in a plain loop with hplab's vocab-parallel loss; and the same models uncut,
    with F.cross_entropy. Losses of each, by model."""
    import copy

    import torch.nn.functional as F

    from hplab.models import llama
    from hplab.parallel import tp

    out = {}
    untied_odd = dataclasses.replace(  # (2,047 words: no split over 2 ranks)
        VARIANTS["one K/V head per query head, untied head"], vocab_size=2047
    )
    mixtral = transformers.MixtralConfig(  # its experts: 3-D parameters, left whole
        **{k: v for k, v in hf.to_hf_config(TINY).to_dict().items() if k != "model_type"},
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    for name, config, cut_by in (
        ("llama", TINY, llama.TP_PLAN),
        ("qwen2", dataclasses.replace(TINY, qkv_bias=True), llama.TP_PLAN),
        ("llama, untied head of 2,047 words", untied_odd, llama.TP_PLAN),
        ("mixtral, attention cut, experts whole", TINY, llama.ATTENTION_TP_PLAN),
    ):
        torch.manual_seed(0)
        kind = getattr(transformers, hf.architecture(config))
        hf_config = mixtral if "mixtral" in name else hf.to_hf_config(config)
        cut = (transformers.MixtralForCausalLM if "mixtral" in name else kind)(hf_config).float()
        whole = copy.deepcopy(cut)
        tp.parallelize(cut, None, cut_by)
        for model, loss_fn in (
            (whole, lambda z, y: F.cross_entropy(z.flatten(0, 1), y.flatten())),
            (cut, lambda z, y: tp.vocab_parallel_cross_entropy(z, y, None, config.vocab_size)),
        ):
            optimizer, losses = torch.optim.AdamW(model.parameters(), lr=3e-3), []
            x, y = tokens(config, seed=0), tokens(config, seed=10)  # one batch, 3 times
            for _ in range(3):
                loss = loss_fn(model(input_ids=x).logits, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss))
            out[name, model is cut] = losses
    return out


KV_SWEEP = [
    (arch, kv, t) for arch in ("llama", "qwen2", "mixtral") for kv in (1, 2, 4) for t in (2, 4)
]


def _hugging_face_k_v_sweep() -> dict:
    """Each shipped plan on transformers' own models (`llama.TP_PLAN` on LlamaForCausalLM and
    Qwen2ForCausalLM, `llama.ATTENTION_TP_PLAN` on MixtralForCausalLM) with 1, 2 and 4 K/V
    heads, cut over tp 2 (a DeviceMesh's "tp" dimension: two groups side by side) and tp 4 (the
    world), then 3 AdamW steps of an ordinary loop (backward, step, zero_grad: nothing else).
    Relative errors of the losses and of the first step's gradients (pieces glued back, as one
    vector) against the uncut model's, by (arch, K/V heads, tp)."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from hplab.models import llama
    from hplab.parallel import placement, tp
    from hplab.parallel.collectives import communicator

    def glued_grads(model, comm):  # every gradient as one vector, tp pieces glued back
        split = {n: placement.of(p).split for n, p in model.named_parameters()}
        return torch.cat(
            [
                (p.grad if split[n] is None else tp.gather_full(p.grad, split[n], comm)).flatten()
                for n, p in sorted(model.named_parameters())
            ]
        )

    def train(model, loss_fn, x, y, comm=None):  # losses, and the first step's gradients
        optimizer, losses, grads = torch.optim.AdamW(model.parameters(), lr=3e-3), [], None
        for _ in range(3):
            loss = loss_fn(model(input_ids=x).logits, y)
            loss.backward()
            grads = glued_grads(model, comm) if grads is None else grads
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return losses, grads

    groups = {2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"], 4: None}
    out = {}
    for arch, kv in dict.fromkeys((arch, kv) for arch, kv, _ in KV_SWEEP):
        config = dataclasses.replace(TINY, n_kv_head=kv, qkv_bias=arch == "qwen2")
        hf_config = hf.to_hf_config(config)
        kind = getattr(transformers, hf.architecture(config))
        if arch == "mixtral":  # its experts: 3-D parameters, left whole
            settings = {k: v for k, v in hf_config.to_dict().items() if k != "model_type"}
            hf_config = transformers.MixtralConfig(
                **settings, num_local_experts=4, num_experts_per_tok=2
            )
            kind = transformers.MixtralForCausalLM
        torch.manual_seed(0)
        whole = kind(hf_config).float()
        initial = copy.deepcopy(whole)
        x, y = tokens(config, seed=0), tokens(config, seed=10)
        want, want_grads = train(
            whole, lambda z, t: F.cross_entropy(z.flatten(0, 1), t.flatten()), x, y
        )
        plan = llama.ATTENTION_TP_PLAN if arch == "mixtral" else llama.TP_PLAN
        for t, group in groups.items():
            cut = tp.parallelize(copy.deepcopy(initial), group, plan)
            loss = functools.partial(
                tp.vocab_parallel_cross_entropy, comm=group, vocab_size=config.vocab_size
            )
            got, grads = train(cut, loss, x, y, communicator(group, "tp"))
            out[arch, kv, t] = dict(
                losses=max(abs(a - b) / abs(b) for a, b in zip(got, want)),
                grads=float((grads - want_grads).norm() / want_grads.norm()),
                trained=want[-1] < want[0],
            )
    return out


def _hugging_face_model_under_context_parallel() -> dict:
    """transformers' LlamaForCausalLM made context-parallel by cp.parallelize over the world:
    each rank hands it only its tokens; its logits, and the gradients averaged over the ranks,
    against the uncut model's on the whole sequence (relative errors, as one vector each)."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F

    from hplab.parallel import cp

    def err(a, b):
        return float((a - b).norm() / b.norm())

    rank, n, out = dist.get_rank(), dist.get_world_size(), {}
    x, y = tokens(TINY, shape=(2, 64)), tokens(TINY, seed=1, shape=(2, 64))
    for style, split in (("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag")):
        torch.manual_seed(0)
        whole = transformers.LlamaForCausalLM(hf.to_hf_config(TINY)).float()
        mine = cp.parallelize(copy.deepcopy(whole), None, style, split)
        reference = whole(input_ids=x, use_cache=False).logits
        F.cross_entropy(reference.flatten(0, 1), y.flatten()).backward()
        xs, ys = (cp.tokens_of(t, rank, n, split) for t in (x, y))
        logits = mine(input_ids=xs, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1), ys.flatten()).backward()
        grads = torch.cat([p.grad.flatten() for p in mine.parameters()])
        dist.all_reduce(grads)
        want = torch.cat([p.grad.flatten() for p in whole.parameters()])
        out[style, split] = dict(
            logits=err(logits, cp.tokens_of(reference, rank, n, split)), grads=err(grads / n, want)
        )
    return out


def _launch(directory: str) -> dict:
    import torch.distributed as dist

    from hplab import train, training

    clip, out = training.clip_grad_norm_, {}
    for name, flags in RUNS[dist.get_world_size()].items():
        norms = out[f"{name}: gradient norms"] = []
        training.clip_grad_norm_ = lambda *args: norms.append(clip(*args)) or norms[-1]
        flags = [flag.format(saved=f"{directory}/saved") for flag in flags]
        metrics = train.run(train.parse_args(TRAIN + flags))  # (rank 0's; None elsewhere)
        out[name] = metrics and [s["loss"] for s in metrics["steps"]]
        if metrics and name.startswith(
            ("tp2 pp2", "tp4,")
        ):  # what each rank holds, for the planner
            out[f"{name}: memory"] = [
                (m["params_bytes"], m["optim_bytes"]) for m in metrics["memory"]
            ]
            out[f"{name}: pp ranks"] = [where["pp_rank"] for where in metrics["mesh"]]
            out[f"{name}: comm"] = metrics["comm_by_group"]
        if metrics and name.startswith("cp4 ring"):  # what each rank sent around the ring
            out[f"{name}: ring bytes"] = [
                g["cp"]["send"]["bytes"] for g in metrics["comm_by_group"]
            ]
    training.clip_grad_norm_ = clip
    if dist.get_world_size() == 4:
        out["hugging face, K/V heads"] = _hugging_face_k_v_sweep()
    if dist.get_world_size() == 2:
        out["hugging face"] = _hugging_face_models_under_tensor_parallel()
        out["hugging face, context parallel"] = _hugging_face_model_under_context_parallel()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    runs = run_distributed(_launch, 4, directory)[0] | run_distributed(_launch, 2, directory)[0]
    return runs | run_distributed(_launch, 1, directory)[0] | {"directory": directory}


@pytest.mark.parametrize("name", FP32)
def test_data_parallel_and_zero_train_the_model_one_process_trains(runs, name):
    reference = runs["one process"]
    assert len(reference) == 3 and reference[-1] < reference[0]
    assert runs[name] == pytest.approx(reference, rel=1e-5, abs=0), name
    norms = runs["one process: gradient norms"]
    assert runs[f"{name}: gradient norms"] == pytest.approx(norms, rel=1e-5), name


@pytest.mark.parametrize("name", [n for n in RUNS[4] if n.startswith("experts")])
def test_mixtral_style_experts_train_the_model_one_process_trains(runs, name):
    """Each SwiGLU MLP swapped for 4 SwiGLU experts behind hplab.parallel.moe's top-2 router: expert
    parallel with ZeRO-1, in a pipeline of 2 microbatches, and with tensor and sequence
    parallel."""
    reference = runs["experts: one process"]
    assert reference != pytest.approx(runs["one process"], rel=1e-3)  # (experts did change it)
    assert runs[name] == pytest.approx(reference, rel=1e-5, abs=0), name
    norms = runs["experts: one process: gradient norms"]
    assert runs[f"{name}: gradient norms"] == pytest.approx(norms, rel=1e-5), name


def test_k_v_heads_shared_by_tp_ranks_are_held_alike_and_their_gradients_summed(runs):
    """llama-tiny's 2 K/V heads over tp 4: rank r holds head r // 2 whole, so each rank holds
    the parameters params_per_stage says (k and v h·d each, not h·kv/4), and after each
    backward the ranks sharing a head add their partial gradients: 2 (k, v) × layers × h·d
    fp32 numbers per step over `tp_kv`, the 2 ranks that share it (the losses equal one
    process's above)."""
    c, steps, name = (
        dataclasses.replace(PRESETS["llama-tiny"], n_layer=2),
        3,
        "tp4, each K/V head on 2 ranks",
    )
    d = c.n_embd // c.n_head
    want = params_per_stage(c, tp=4)["first"]
    assert [params for params, _ in runs[f"{name}: memory"]] == [4 * want] * 4
    summed = [g["tp_kv"]["all_reduce"]["bytes"] for g in runs[f"{name}: comm"]]
    assert summed == [steps * 2 * c.n_layer * c.n_embd * d * 4] * 4
    # its checkpoint glues one copy of each head back: one process's model (as one vector)
    saved, one = (
        checkpoint.load(f"{runs['directory']}/saved-{n}")["model"] for n in ("tp4", "one")
    )
    assert saved.keys() == one.keys()
    got, want = (torch.cat([m[n].flatten() for n in sorted(one)]) for m in (saved, one))
    assert float((got - want).norm()) <= 1e-5 * float(want.norm())


def test_the_ring_carries_only_the_k_v_heads(runs):
    """Under grouped-query attention a K/V block is 2·b·(s/N)·h_kv numbers, h_kv = n_kv_head·d:
    2 of llama-tiny's 4 heads, half of what the same ring moves for a model with a K/V head per
    query head (formulas.ring_attention_bytes with the K/V width)."""
    from hplab.plan.formulas import ring_attention_bytes

    c, steps, cp = dataclasses.replace(PRESETS["llama-tiny"], n_layer=2), 3, 4
    kv_width = c.kv_heads * c.n_embd // c.n_head
    per_layer = ring_attention_bytes(4, c.n_positions, kv_width, cp)  # 4 sequences a step
    want = steps * c.n_layer * (per_layer["forward"] + per_layer["backward"])
    assert runs["cp4 ring contiguous: ring bytes"] == [want] * cp
    assert kv_width * 2 == c.n_embd
    planned = plan(c, Layout(cp=cp, cp_split="contiguous", batch_size=4))["cp_bytes_per_step"]
    assert planned * steps == want  # the planner's ring, K/V heads only


def test_the_planner_has_llama_3s_shapes():
    """8.0B, 70.6B and 405.9B parameters, as Meta counts its released models."""
    presets = __import__("hplab.plan", fromlist=["model_presets"]).model_presets()
    for name, billions in (("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)):
        assert presets[name].num_params() / 1e9 == pytest.approx(billions, abs=0.01), name
    layout = Layout(tp=8, pp=16, dp=8, zero=1, batch_size=1024, microbatches=16)
    assert plan(presets["llama3-405b"], layout)["memory_bytes_per_gpu"] > 0


def test_the_planner_counts_a_llama_as_a_run_holds_it(runs):
    """GQA, SwiGLU, RMSNorm, RoPE and an untied-or-tied head in the planner's formulas: each
    rank of tp2 × pp2 holds the parameters and Adam state params_per_stage says, to the byte;
    one forward pass keeps the activations activation_memory says, within 0.5% (fp32 and bf16,
    with and without recompute)."""
    from hplab.observe import memory

    c = dataclasses.replace(PRESETS["llama-tiny"], n_layer=2)
    stage = params_per_stage(c, tp=2, pp=2)
    held = runs["tp2 pp2 1f1b, 2 microbatches: memory"]
    for (params, optim), pp_rank in zip(held, runs["tp2 pp2 1f1b, 2 microbatches: pp ranks"]):
        want = stage[("first", "last")[pp_rank]]
        assert (params, optim) == (4 * want, 8 * want), pp_rank
    for precision, recompute in (("fp32", "none"), ("bf16", "selective"), ("fp32", "full")):
        model = build_model(PRESETS["llama-tiny"]).to(
            getattr(torch, {"fp32": "float32"}.get(precision, "bfloat16"))
        )
        model.recompute = recompute
        ledger = memory.MemoryLedger()
        x = tokens(PRESETS["llama-tiny"], shape=(4, 64))
        with ledger.track_activations(exclude=list(model.parameters())):
            model(x, x)
        lay = Layout(batch_size=4, precision=precision, recompute=recompute)
        want = plan(PRESETS["llama-tiny"], lay)["activation_bytes_per_microbatch"]
        assert abs(want / ledger.activation_bytes - 1) < 0.005, (precision, recompute)


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen2",
        "llama, untied head of 2,047 words",
        "mixtral, attention cut, experts whole",
    ],
)
def test_the_plan_cuts_hugging_faces_own_llama_and_qwen2(runs, name):
    """tp.parallelize(LlamaForCausalLM or Qwen2ForCausalLM, group, llama.TP_PLAN) in an ordinary
    loop, with tp.vocab_parallel_cross_entropy on its V/T logits: transformers' attention reads
    its heads from the cut widths, so 2 ranks train what one process trains (1e-5)."""
    losses = runs["hugging face"]
    assert losses[name, True] == pytest.approx(losses[name, False], rel=1e-5, abs=0)
    assert losses[name, False][-1] < losses[name, False][0]


@pytest.mark.parametrize("case", KV_SWEEP, ids=[f"{a}-kv{k}-tp{t}" for a, k, t in KV_SWEEP])
def test_every_plan_trains_hugging_faces_models_with_any_k_v_heads_in_a_plain_loop(runs, case):
    """transformers' Llama, Qwen2 and Mixtral with 1, 2 and 4 K/V heads, cut at tp 2 and 4 and
    trained in an ordinary loop: where several ranks hold one K/V head (fewer heads than ranks),
    each rank's gradient is a part of the whole, and the hook tp.parallelize sets sums the parts in
    backward, so its gradients are one process's and 3 AdamW steps give its losses (fp32: 1e-5)."""
    errors = runs["hugging face, K/V heads"][case]
    assert errors["trained"]
    assert errors["losses"] <= 1e-5 and errors["grads"] <= 1e-5, errors


@pytest.mark.parametrize(
    "case", [("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag")]
)
def test_context_parallel_on_hugging_faces_llama(runs, case):
    """cp.parallelize(LlamaForCausalLM, group, style, split): the same contract as on hplab's
    models — each rank hands it its tokens and gets their logits at their true positions (RoPE
    through `position_ids`, attention through transformers' AttentionInterface) — so logits and
    averaged gradients equal the whole model's on the whole sequence (1e-5)."""
    errors = runs["hugging face, context parallel"][case]
    assert errors["logits"] < 1e-5 and errors["grads"] < 1e-5, errors


def test_bf16_and_a_resharded_resume_follow_one_process(runs):
    """bf16 under dp2 + ZeRO-1 against one process in bf16 (within one bf16 rounding, 2⁻⁸);
    saved under dp2 + ZeRO-3 after 2 steps, resumed on one process: its third step is the
    uninterrupted run's (fp32, 1e-5)."""
    assert runs["dp2 zero1 bf16"] == pytest.approx(runs["one process bf16"], rel=2**-8, abs=0)
    assert runs["dp2 zero3, saved at step 2"] == pytest.approx(runs["one process"][:2], rel=1e-5)
    resumed = runs["one process, resumed at step 2"]
    assert resumed == pytest.approx(runs["one process"][2:], rel=1e-5, abs=0)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            "--model llama-tiny --n-head 6 --n-kv-head 3 --n-embd 192 --tp 2",
            "--tp 2 and 3 K/V heads: one must divide the other",
        ),
        ("--model llama-tiny --n-kv-head 3", "--n-kv-head 3 must divide --n-head (4)"),
        ("--n-kv-head 2", "--n-kv-head: GPT-2 has as many K/V heads as heads"),
    ],
)
def test_what_does_not_run_on_llama_yet_is_one_line(flags, says, capsys):
    from hplab import train

    assert train.main(["--nproc", "2", "--steps", "1", *flags.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
