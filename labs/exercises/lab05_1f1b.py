"""Lab 05 exercise: the 1F1B pipeline schedule as a list of actions per rank.

Implement `one_f_one_b(p, m)`, then check it:

    python -m hplab.check one_f_one_b                 # checks this file
    python -m hplab.check one_f_one_b path/to/yours.py

Return, for each of the p ranks (stages), the order in which it runs the forward ("F", i) and
the backward ("B", i) of every microbatch i = 0 ... m-1. For example GPipe is

    [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for r in range(p)]

1F1B (PipeDream-Flush) runs the same work in an order that frees memory early:
  * warm-up: rank r first runs forwards only, as many as will be in flight before the first
    backward can come back to it — how many is that for the last rank? for the first?
    (never more than m);
  * steady state: then it alternates one forward and one backward (the oldest microbatch
    whose forward it ran);
  * cool-down: when no forwards are left, it runs the remaining backwards.

The checker turns your orders into full action lists (sends and receives added), runs them in
`hplab.plan.simulate.simulate` with F = B = 1 for p = 2 ... 8 and m = 1 ... 12, and reports: missing
or repeated work, a B before its F, deadlocks, the step time (makespan) against 1F1B's, the
activations each rank holds at most (1F1B: p − r, at most m), and the first action that differs
from the reference order.
"""


def one_f_one_b(p: int, m: int) -> list[list[tuple[str, int]]]:
    raise NotImplementedError("warm-up forwards, then one forward one backward, then cool-down")
