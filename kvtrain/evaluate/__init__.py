"""Benchmarks of a trained model through lm-evaluation-harness, offline
(``kvtrain eval``): ``harness`` runs lm-eval on a Hugging Face folder,
``source`` turns a run or checkpoint into one, ``report`` writes the results."""
