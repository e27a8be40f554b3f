"""Pieces of ``benchmarks/suite.py``: the model suite of issue 13
(:mod:`.models`), its reference optima (:mod:`.references`), the methods (:mod:`.baselines`),
the epoch loop (:mod:`.runner`), the metrics (:mod:`.metrics`) and the report (:mod:`.report`)."""
