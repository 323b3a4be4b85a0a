"""Lab 11 exercise: how often to save a checkpoint.

Implement both functions, then check them:

    python -m hplab.check goodput                 # checks this file
    python -m hplab.check goodput path/to/yours.py

A cluster fails on average once every `mtbf_s` seconds. A checkpoint stops training for
`checkpoint_s` seconds; after a failure, restarting costs `restart_s` seconds plus the training
done since the last checkpoint: on average half of an interval of training and its save. Saving
after every `interval_s` seconds of training, the share of wall-clock time that trains is, to
first order in 1/MTBF, the fraction of time not spent saving times the fraction not lost to
failures (each failure costs the restart and half an interval with its save).
"""


def goodput(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """The share of wall-clock time spent training, between 0 and 1 (0 when failures would
    take more than all of it)."""
    raise NotImplementedError("(time training ÷ time training and saving) × (1 − lost ÷ MTBF)")


def best_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The interval that maximises goodput to first order (Young 1974): where the saving cost
    per second, C/τ, and the expected loss per second, τ/(2·MTBF), balance."""
    raise NotImplementedError("minimise C/τ + τ/(2·MTBF)")
