"""Comparing finished runs (`python eval.py --compare`), beside eval.py: never part of a step.

  compare     arms of runs against a baseline: the area, the targets, paired ratios, verdicts
  area        the area over a budget of generated tokens, the budget, the tuned baseline
  compare_io  what it reads of each run folder (every field checked) and the tables it writes
  stats       intervals, Welch's t-test, Holm's correction, the paired bootstrap, AES
  evals       which eval curve is compared (--metric): avg@k, pass@k, maj@k or greedy
  curve       the saving to every fraction of the baseline's gain (curve.md)
  cost        GPU time as a stated model over c_gen / c_train, prompt prefill counted
"""
