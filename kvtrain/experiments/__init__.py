"""Experiments that reproduce the paper's toy results (Figure 1a/1b, Appendix E.3).

* ``metrics``   - masked next-token accuracy at the induction / 3-gram positions
* ``induction`` - the experiment grid (presets x scales), its runner, results.csv
  and accuracy.png
* ``standalone`` - a small single-process training loop (GPTModel from
  ``build_gpt`` + torch AdamW) used by the runner
"""
