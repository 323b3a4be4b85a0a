"""Observing a run from outside: the observers train.py attaches (`observers`: timings, traces,
the pipeline's timeline), the collectives' ranges in a profiler's timeline (`ranges`), where a
rank's memory goes (`memory`, from the tensors it holds), and the metrics file every notebook,
test and benchmark reads (`metrics`)."""
