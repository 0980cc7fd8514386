"""Experiments that reproduce the paper's toy results (Figure 1a/1b, Appendix
E.3) through the one trainer: an experiment is a generator of ``kvtrain
train`` run configs, one per arm.

* ``presets`` - the grids (presets x scales) as run configs, the arms, and
  the user's ``--set`` overrides (``kvtrain train``'s grammar)
* ``runner``  - trains each arm with ``kvtrain train`` (arms side by side)
  and writes the results
* ``results`` - curves from each run's ``metrics.jsonl``, results.csv,
  accuracy.png, loss.png, summary.json
* ``landscape`` - Figure 2: Theorem 3.4's analytic loss over the coefficients
  (no training)

The tasks' data and accuracy live in ``kvtrain.tasks``.
"""
