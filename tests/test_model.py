"""hplab's GPT-2 is Hugging Face's GPT-2: same names, same weights, same logits."""

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


def test_recompute_gives_identical_gradients_with_fewer_saved_bytes():
    from hplab.memory import MemoryLedger

    grads, saved = [], []
    idx = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(0))
    for recompute in (False, True):
        model = build_model(PRESETS["tiny"], seed=0)
        model.recompute = recompute
        ledger = MemoryLedger()
        with ledger.track_activations(exclude=model.parameters()):
            _, loss = model(idx, idx)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        saved.append(ledger.activation_bytes)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert saved[1] < saved[0] / 2
