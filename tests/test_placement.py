"""Where each parameter lives: one typed record per parameter (hplab/parallel/placement.py),
never attributes set on the parameter, and `hplab.placement(model)`, the table a learner reads."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hplab
from hplab.runtime.launch import run_distributed

LIBRARY = Path(__file__).resolve().parent.parent / "hplab"
PLACEMENT = LIBRARY / "parallel" / "placement.py"
# the markers placement used to be, and the one attribute it might have become
MARKERS = {
    "tp_split",
    "sequence_parallel_partial",
    "tp_every_token",
    "hplab_expert",
    "hplab_no_decay",
    "sharded_over",
    "_fsdp",
    "_gradients_synced_by",
    "placement",
}


def marker_sites(path: Path) -> list[str]:
    """Where `path` sets or reads a marker as an attribute (`x.tp_split = ...`,
    `setattr(x, "tp_split", ...)`, `getattr(x, "hplab_expert", ...)`, `hasattr`)."""
    sites = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and part.attr in MARKERS:
                    sites.append(f"{path.name}:{node.lineno} sets .{part.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            is_attribute_call = node.func.id in ("setattr", "getattr", "hasattr", "delattr")
            name = node.args[1] if len(node.args) > 1 else None
            if is_attribute_call and isinstance(name, ast.Constant) and name.value in MARKERS:
                sites.append(f"{path.name}:{node.lineno} {node.func.id}(…, {name.value!r})")
    return sites


def test_no_placement_attribute_outside_the_placement_module():
    """Placement is one record per parameter, kept by placement.py: no module of the library
    sets (or reads) a placement marker on a parameter, and nothing copies markers any more."""
    sites = [s for p in LIBRARY.rglob("*.py") if p != PLACEMENT for s in marker_sites(p)]
    assert sites == []
    texts = {p.name: p.read_text() for p in LIBRARY.rglob("*.py")}
    assert [name for name, text in texts.items() if "copy_markers" in text] == []
    assert [name for name, text in texts.items() if '"replicated_over"' in text] == []


def test_a_plain_model_is_replicated_everywhere():
    """One process, no strategy: every parameter whole, its shape here its global shape."""
    from hplab.models.gpt import build_model, config_from_preset

    model = build_model(config_from_preset("tiny"), 0)
    table = hplab.placement(model)
    assert [row[0] for row in table.rows] == [n for n, _ in model.named_parameters()]
    for name, here, whole, dp, cp, tp, also in table.rows:
        assert (here, dp, cp, tp, also) == (whole, "R", "R", "R", ""), name
    text = str(table)
    assert text.startswith("name") and "global shape" in text.splitlines()[0]
    assert repr(table) == text and "transformer.wte.weight" in text


def test_a_pipeline_stage_marks_its_copy_of_the_tied_embedding():
    """Split over two pipeline ranks, the tied embedding / LM head has a copy on each end, its
    gradient a part of the whole over the two (the executor sums them): the record says so,
    the table too, and a single-stage model has no such copy."""
    from hplab.models.gpt import build_model, config_from_preset
    from hplab.parallel import placement, pp

    for rank in (0, 1):
        model = build_model(config_from_preset("tiny"), 0)
        stages = pp.build_stages(model, rank, 2)
        weight = model.lm_head.weight
        assert pp.tied_weight(stages) is weight and placement.of(weight).pipeline_ends
        assert placement.of(weight).partial_grad_over == ("pp_ends",)
        row = {r[0]: r for r in hplab.placement(model).rows}["transformer.wte.weight"]
        assert row[5] == "R" and row[6].startswith("tied: a copy on the first and last stage")
    whole = build_model(config_from_preset("tiny"), 0)
    pp.build_stages(whole, 0, 1)
    assert not placement.of(whole.lm_head.weight).pipeline_ends


def test_the_record_is_typed_in_dtensors_words():
    from hplab.parallel import placement
    from hplab.parallel.placement import Partial, Replicate, Shard

    p = nn.Parameter(torch.zeros(4, 2))
    assert placement.of(p) == placement.ParamPlacement() and placement.of(p).tp == Replicate()
    placement.update(p, split=placement.Split(0, replicas=2), tp_grad=Partial())
    assert placement.of(p).tp == Shard(0) and placement.of(p).kv_replicas == 2
    assert placement.of(p).partial_grad_over == ("tp", "tp_kv")
    master = torch.zeros(4, 2)
    placement.derive(p, master, dp=Shard(0), sharded_over="dp_cp")
    assert placement.of(master).split == placement.Split(0, replicas=2)
    assert placement.of(master).copies_over == ("dp", "cp")  # cut over tp: no copies there
    assert vars(p) == {}  # nothing on the parameter itself


def test_the_three_placements_are_dtensors_own_by_name_meaning_and_print():
    """hplab's Shard, Replicate and Partial (small classes: DTensor takes 2.5 s to import) print
    as DTensor's do and turn into DTensor's own."""
    from torch.distributed.tensor import placement_types as torch_placements

    from hplab.parallel import placement

    for mine, theirs in (
        (placement.Shard(1), torch_placements.Shard(1)),
        (placement.Replicate(), torch_placements.Replicate()),
        (placement.Partial(), torch_placements.Partial()),
    ):
        assert mine.dtensor() == theirs
        assert (str(mine), repr(mine)) == (str(theirs), repr(theirs))


def test_no_building_block_imports_dtensor_or_torchs_fsdp_at_start():
    """A process that imports hplab's training command loads neither torch.distributed.tensor
    nor torch.distributed.fsdp (2.5 s each on a laptop CPU, paid by every rank of every run)."""
    code = (
        "import sys, hplab.train, hplab.course.check.runner; "
        "print([m for m in ('torch.distributed.tensor', 'torch.distributed.fsdp') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _rows(model) -> dict:
    return {row[0]: row[1:] for row in hplab.placement(model).rows}


def _worker():
    """Two ranks: a Llama with one K/V head cut over tp 2 with sequence parallel; a tiny GPT
    fully sharded; a linear layer under ZeRO-2. Each one's table, and the parameters' own
    attributes (none: the records live in placement.py)."""
    from hplab.models.gpt import PRESETS, build_model, config_from_preset
    from hplab.models.llama import TP_PLAN
    from hplab.parallel import placement, tp
    from hplab.training import mark_no_decay

    out = {}
    config = dataclasses.replace(PRESETS["llama-tiny"], n_layer=1, n_kv_head=1)
    llama = build_model(config, 0)
    mark_no_decay(llama)
    tp.parallelize(llama, None, TP_PLAN, sequence_parallel=True)
    out["tp"], out["tp_text"] = _rows(llama), str(hplab.placement(llama))
    gpt = build_model(config_from_preset("tiny"), 0)
    for block in [*gpt.blocks, gpt]:
        hplab.fully_shard(block)
    out["fsdp"] = _rows(gpt)
    linear = nn.Linear(4, 3)
    zero = hplab.ZeroOptimizer(linear.parameters(), torch.optim.SGD, stage=2, lr=0.1)
    out["zero"] = _rows(linear)
    master = zero.buckets[0].master  # one bucket: weight and bias, 15 numbers padded to 16
    record = placement.of(master)
    out["zero_master"] = (str(record.dp), record.sharded_over, record.global_shape, master.shape)
    params = [*llama.parameters(), *gpt.parameters(), *linear.parameters()]
    out["attributes"] = sorted({a for p in params for a in vars(p)})
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2)


def test_tensor_parallel_llama_table(results):
    """q_proj cut by rows; the single K/V head held whole by both ranks, its gradient Partial
    over them; norms whole under sequence parallel, their gradient Partial over tp."""
    rows = results[0]["tp"]
    layer = "model.layers.0"
    q = rows[f"{layer}.self_attn.q_proj.weight"]
    assert q[:4] == ["(64, 128)", "(128, 128)", "R", "R"] and q[4] == "S(0)"
    k = rows[f"{layer}.self_attn.k_proj.weight"]
    assert k[:2] == ["(32, 128)", "(32, 128)"] and k[4] == "S(0) (grad P)"
    assert "K/V on 2 ranks" in k[5]
    norm = rows[f"{layer}.input_layernorm.weight"]
    assert norm[4] == "R (grad P)" and "no decay" in norm[5]
    assert rows[f"{layer}.mlp.down_proj.weight"][4] == "S(1)"
    assert "K/V on 2 ranks" in results[0]["tp_text"]


def test_fully_sharded_and_zero_tables(results):
    """fully_shard: every parameter a Shard(0) of its global shape, synced by fully_shard;
    ZeRO-2: the parameters stay whole, their optimizer state in flat shards."""
    for name, (here, whole, dp, cp, tp, also) in results[1]["fsdp"].items():
        rows = -(-ast.literal_eval(whole)[0] // 2)  # ceil(d0 / 2)
        assert ast.literal_eval(here)[0] == rows and (dp, cp, tp) == ("S(0)", "R", "R"), name
        assert also == "synced by hplab.fully_shard", name
    weight = results[0]["zero"]["weight"]
    assert weight[:5] == ["(3, 4)", "(3, 4)", "R", "R", "R"]
    assert weight[5] == "ZeRO Flat(1/2) over dp, synced by hplab.ZeroOptimizer(stage=2)"
    assert results[1]["zero_master"] == ("Flat(1/2)", "dp", (16,), (8,))


def test_no_attribute_is_set_on_a_parameter(results):
    assert results[0]["attributes"] == results[1]["attributes"] == []
