"""The course's tools, built on the library: the exercise checkers (`course.check`), the plots
(`course.viz`), the notebook helpers (`course.lab`), the trace analysis (`course.timeline`) and
the collectives benchmark (`course.collectives_bench`).

The course imports the library; the library (`hplab/` outside `course/`) never imports the
course. `from hplab import lab, viz` and `python -m hplab.check NAME` keep working: hplab
resolves those names here.
"""
