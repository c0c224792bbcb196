"""Comparing finished runs (`python eval.py --compare`), beside eval.py: never part of a step.

  compare     arms of runs against a baseline: the area, the targets, paired ratios, verdicts
  compare_io  what it reads of each run folder (every field checked) and the tables it writes
  stats       intervals, Welch's t-test, Holm's correction, the paired bootstrap, AES
"""
