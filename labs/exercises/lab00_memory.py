"""Lab 00 exercise: count a model's training memory by hand.

Fill in the two functions below, then check them against what the MemoryLedger measures on the
real model after an AdamW step (three model shapes):

    python -m hplab.check memory                 # checks this file
    python -m hplab.check memory path/to/yours.py

`config` is a `hplab.models.gpt.GPTConfig` with
    vocab_size   V   tokens in the vocabulary
    n_positions  S   longest sequence (the position-embedding table has S rows)
    n_embd       h   hidden size
    n_layer      L   transformer blocks
    n_head           attention heads (they split h; they add no parameters)

Look at `hplab/models/gpt.py` for the layers. Do not call `config.num_params()`: it is the
answer.
"""


def num_params(config) -> int:
    """Ψ: the trainable parameters of hplab's GPT. The LM head shares its weight with the token
    embedding (tied), so that matrix counts once. Every linear layer has a bias; every layer
    norm has a weight and a bias of h numbers."""
    V, S, h, L = config.vocab_size, config.n_positions, config.n_embd, config.n_layer
    # embeddings:     token table V × h, position table S × h
    # one block:      ln_1, attention (qkv: h → 3h, output projection: h → h), ln_2,
    #                 MLP (h → 4h, 4h → h)
    # after the blocks: the final layer norm ln_f
    raise NotImplementedError("count the parameters of the embeddings, the L blocks and ln_f")


def model_state_bytes(config) -> dict:
    """Bytes of the model states of fp32 training with AdamW, by kind:

        {"params": ..., "grads": ..., "optim": ...}

    fp32 takes 4 bytes a number; AdamW keeps two running averages per parameter
    (exp_avg and exp_avg_sq)."""
    raise NotImplementedError("bytes of the parameters, their gradients and AdamW's state")
