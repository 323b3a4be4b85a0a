"""hplab's GPT-2 is Hugging Face's GPT-2: same names, same weights, same logits."""

from dataclasses import replace

import pytest
import torch

from hplab.models.gpt import (
    PRESETS,
    GPTConfig,
    build_model,
    config_from_preset,
    from_hf_state_dict,
    to_hf_config,
    to_hf_state_dict,
)

transformers = pytest.importorskip("transformers")


def small_config():
    # odd sizes on purpose: 3 layers, 6 heads, a vocabulary that is no power of two
    return GPTConfig(vocab_size=1001, n_positions=32, n_embd=48, n_layer=3, n_head=6)


def test_weights_convert_both_ways_and_logits_match_hugging_face():
    config = small_config()
    ours = build_model(config, seed=1).eval()
    hf = transformers.GPT2LMHeadModel(to_hf_config(config)).eval()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict()))
    assert set(hf.state_dict()) >= set(ours.state_dict())  # the very same names
    idx = torch.randint(
        0, config.vocab_size, (2, config.n_positions), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours_logits, ours_loss = ours(idx, idx)
        out = hf(input_ids=idx)
    assert torch.allclose(ours_logits, out.logits, rtol=1e-5, atol=1e-5)
    back = build_model(config, seed=2)
    back.load_state_dict(from_hf_state_dict(hf.state_dict()))
    for name, t in ours.state_dict().items():
        assert torch.equal(t, back.state_dict()[name]), name
    assert back.lm_head.weight is back.transformer.wte.weight  # tie survives the round trip


def test_initial_weights_depend_only_on_the_seed():
    a, b = build_model(PRESETS["tiny"], seed=3), build_model(PRESETS["tiny"], seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_model(PRESETS["tiny"], seed=4)
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)


def test_parameter_count_formula_matches_the_model():
    for config in (PRESETS["tiny"], small_config()):
        assert config.num_params() == sum(p.numel() for p in build_model(config).parameters())
    assert PRESETS["gpt2"].num_params() == 124_439_808  # GPT-2 small, tied head


def test_presets_and_overrides():
    c = config_from_preset("gpt2-medium")
    assert (c.n_layer, c.n_embd, c.n_head, c.vocab_size) == (24, 1024, 16, 50257)
    c = config_from_preset("tiny", n_layer=2, seq_len=32)
    assert (c.n_layer, c.n_positions, c.n_embd) == (2, 32, 64)
    with pytest.raises(ValueError, match="unknown model preset"):
        config_from_preset("gpt5")
    with pytest.raises(ValueError, match="not divisible by n_head"):
        config_from_preset("tiny", n_embd=66)


@pytest.mark.parametrize("flash_attention", [True, False], ids=["fused", "unfused"])
def test_recompute_gives_identical_gradients_with_fewer_saved_bytes(flash_attention):
    """Full and selective recompute change what backward keeps, never what it computes. With
    the unfused attention selective recompute drops the s×s scores; with a fused one there is
    little left to drop (its log-sum-exp per row)."""
    from hplab.observe.memory import MemoryLedger

    config = replace(PRESETS["tiny"], flash_attention=flash_attention)
    grads, saved, losses = {}, {}, {}
    idx = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(0))
    for recompute in ("none", "selective", "full", True, False):
        model = build_model(config, seed=0)
        model.recompute = recompute
        ledger = MemoryLedger()
        with ledger.track_activations(exclude=model.parameters()):
            _, losses[recompute] = model(idx, idx)
        losses[recompute].backward()
        grads[recompute] = [p.grad.clone() for p in model.parameters()]
        saved[recompute] = ledger.activation_bytes
    for mode in ("selective", "full", True, False):
        assert torch.equal(losses[mode], losses["none"])
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["none"])), mode
    assert saved[True] == saved["full"] < saved["none"] / 2 and saved[False] == saved["none"]
    scores = 4 * 4 * 64 * 64 * 4  # b·a·s²·4 bytes per layer: what the unfused attention keeps
    lse = 4 * 4 * 64 * 4  # b·a·s·4: a fused attention's log-sum-exp
    dropped = (saved["none"] - saved["selective"]) / config.n_layer
    assert dropped == (lse if flash_attention else scores)
    with pytest.raises(ValueError, match="choose none, selective or full"):
        model.recompute = "some"


def test_unfused_attention_equals_the_fused_one():
    from hplab.models.gpt import causal_attention, unfused_causal_attention

    q, k, v = torch.randn(3, 2, 4, 16, 8).unbind(0)
    fused, unfused = causal_attention(q, k, v), unfused_causal_attention(q, k, v)
    assert torch.allclose(unfused, fused, rtol=1e-5, atol=1e-6)
