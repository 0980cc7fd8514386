"""The paper's toy tasks, as a leaf package that config, data and train import.

* ``config``    - the options of ``data.type: induction | ngram | hop`` (the
  ``data.induction`` / ``data.ngram`` / ``data.hop`` sections; each field
  written once) and the accuracy masks each task reports
* ``sequences`` - the samples: Appendix K's induction data, Appendix E.3's
  3-grams (numpy; pure functions of ``(task, seed, index)``)
* ``hops``      - Appendix E.1's k-hop induction heads task (Sanford et al.)
* ``accuracy``  - masked next-token accuracy, and the accuracy inside the
  trainer's validation (megatron forward step, loss function, reduction)

Nothing here imports another kvtrain package (``tests/test_import_graph.py``):
config errors are raised as ``ValueError`` and named by the caller.
"""
