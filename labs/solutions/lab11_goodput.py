"""Lab 11 exercise (reference solution): goodput and Young's checkpoint interval.

Check it with `python -m hplab.check goodput labs/solutions/lab11_goodput.py`.
"""

import math


def goodput(interval_s, checkpoint_s, restart_s, mtbf_s):
    saving = interval_s / (interval_s + checkpoint_s)  # the share not spent saving
    lost = (restart_s + (interval_s + checkpoint_s) / 2) / mtbf_s  # per failure, per MTBF
    return max(0.0, saving * (1 - lost))


def best_interval(checkpoint_s, mtbf_s):
    return math.sqrt(2 * checkpoint_s * mtbf_s)  # d/dτ (C/τ + τ/(2M)) = 0
