"""Experiments that reproduce the paper's toy results (Figure 1a/1b, Appendix E.3).

* ``metrics``         - masked next-token accuracy at the induction / 3-gram positions
* ``induction``       - the experiment grid (presets x scales), its runner,
  results.csv, accuracy.png, loss.png and summary.json
* ``standalone``      - the default back end: a single-process training loop
  (GPTModel from ``build_gpt`` + torch AdamW)
* ``trainer_backend`` - the other back end: one ``kvtrain train`` run per arm
  (``data.type: induction | ngram``, docs/induction.md)
* ``validation``      - the accuracy inside ``kvtrain train``'s validation

The data live in ``kvtrain.data.induction``.
"""
