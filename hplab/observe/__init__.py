"""Observing a run from outside: the observers train.py attaches (`observers`: timings, traces,
the pipeline's timeline), the collectives' ranges in a profiler's timeline (`ranges`), where a
rank's memory goes (`memory`, from the tensors it holds), the metrics file every notebook, test
and benchmark reads (`metrics`), and where each parameter lives (`placement_table`:
`print(hplab.placement(model))`)."""
