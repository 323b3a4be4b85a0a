"""Lab 00 solution: a model's training memory, counted by hand (see labs/exercises/)."""


def num_params(config) -> int:
    """Ψ = V·h + S·h + L·(12h² + 13h) + 2h."""
    V, S, h, L = config.vocab_size, config.n_positions, config.n_embd, config.n_layer
    embeddings = V * h + S * h  # token table (shared with the LM head) + position table
    layer_norm = 2 * h  # weight and bias
    attention = (h * 3 * h + 3 * h) + (h * h + h)  # qkv projection, output projection
    mlp = (h * 4 * h + 4 * h) + (4 * h * h + h)  # up to 4h, back down to h
    block = 2 * layer_norm + attention + mlp  # = 12h² + 13h
    return embeddings + L * block + layer_norm  # + the final layer norm


def model_state_bytes(config) -> dict:
    """fp32 + AdamW: 4Ψ params, 4Ψ grads, 8Ψ optimizer state (exp_avg, exp_avg_sq)."""
    psi = num_params(config)
    return {"params": 4 * psi, "grads": 4 * psi, "optim": 2 * 4 * psi}
