"""The parameters an experiment's results give each arm (``results.csv``,
``summary.json``): the model its run trained, at the run's layout."""

from __future__ import annotations

from kvtrain.config import load_config
from kvtrain.experiments.runner import _params
from kvtrain.plan.params import count_params
from tests.launch.conftest import REPO

TINY = REPO / "configs" / "tiny.yaml"


def test_an_arm_at_tp_2_counts_the_vocabulary_it_padded_for_tp_2():
    """300 words pad to 384 at TP 2 (make_vocab_size_divisible_by 64 x 2), as megatron
    builds the embedding; before, the count padded as at TP 1 (320): 2 x 64 x 64 fewer."""
    cfg = load_config(TINY, ["model.vocab_size=300", "parallel.tensor=2"])
    trained = count_params(cfg.model, 2)
    assert trained.vocab_padded == 384
    assert _params(cfg) == {"total": trained.total, "non_embedding": trained.non_embedding}
