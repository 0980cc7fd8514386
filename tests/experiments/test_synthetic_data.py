"""The toy-task data: Appendix K's induction sequences and Appendix E.3's 3-grams."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrain.data.induction import SyntheticDataset, train_and_eval
from kvtrain.tasks.sequences import (
    PAD,
    InductionTask,
    NgramTask,
    appk_sequence,
    build_task,
    ngram_table,
    sample_rng,
)

SMALL = InductionTask(seq_length=64, max_val=200)


def raw_of(sample) -> list[int]:
    """The raw sequence (tokens + last label), without padding."""
    toks = sample["tokens"].tolist() + [int(sample["labels"][-1])]
    n = int(sample["loss_mask"].sum()) + 1
    return toks[:n]


# ----------------------------------------------------------------------------- App. K
def appk_script(pool: list[int], draws, length: int):
    """Appendix K's generator, as printed (with the extraction's lost ``<``/``>``
    restored), with ``random.shuffle``/``random.choice`` replaced by the given
    pool and draw stream. Returns the raw array (no padding) and every
    predict position."""
    array, predict_positions, di = [], [], {}
    while len(array) < length:
        x = pool[next(draws)]
        if (len(array) == 0) or (x != array[-1]):
            if x not in di:
                if len(array) > 0:
                    di[array[-1]] = x
                di[x] = -1
                array.append(x)
            else:
                predict_positions.append(len(array))
                array.append(x)
                array.append(di[x])
    return array, predict_positions


class RecordingRng:
    """Wraps a numpy Generator and records the pool permutation and the draws."""

    def __init__(self, rng):
        self.rng, self.perms, self.draws = rng, [], []

    def permutation(self, n):
        out = self.rng.permutation(n)
        self.perms.append(out)
        return out

    def integers(self, lo, hi, size):
        out = self.rng.integers(lo, hi, size=size)
        self.draws.extend(out.tolist())
        return out


@pytest.mark.parametrize("index", range(40))
def test_agrees_with_the_appendix_k_script_on_the_scored_prefix(index):
    """Fed the same pool and draws, the script and this generator produce the
    same tokens up to the first prediction position and its label (the position
    the paper scores), and the same first prediction position."""
    length, mid, max_val = 128, 10, 1024
    rec = RecordingRng(np.random.default_rng(index))
    raw, predict = appk_sequence(rec, length, mid, max_val)
    assert len(rec.perms) == 1  # not regenerated (a repeat within 128 draws of 128)
    pool = (rec.perms[0][:length] + mid + 1).tolist()
    ref, ref_predict = appk_script(pool, iter(rec.draws), length)
    p = predict[0]
    assert ref_predict[0] == p
    assert ref[:p + 2] == raw[:p + 2]


def test_script_emits_invalid_tokens_that_the_repair_avoids():
    """The printed script leaves di[t] = -1 when t is followed by a repeated
    token; a later repeat of t emits -1. The repaired generator never does."""
    seen_minus_one = False
    for index in range(200):
        rec = RecordingRng(np.random.default_rng(index))
        raw, _ = appk_sequence(rec, 128, 10, 1024)
        pool = (rec.perms[0][:128] + 11).tolist()
        ref, _ = appk_script(pool, iter(rec.draws), 128)
        seen_minus_one |= -1 in ref
        assert min(raw) >= 11
    assert seen_minus_one


def latest_before(raw, p):
    for i in range(p - 1, -1, -1):
        if raw[i] == raw[p]:
            return i
    return None


@pytest.mark.parametrize("task", [SMALL, InductionTask(seq_length=128, max_val=1024),
                                  InductionTask(seq_length=96, length=60, max_val=300,
                                                pool_size=40)])
def test_induction_masks_and_the_copy_rule(task):
    """At every prediction position p, tokens[p] occurred before and the next
    token copies what followed its latest earlier occurrence; the first
    position's token occurred exactly once before and every earlier token is
    distinct; ``induction_first`` is the first of ``induction_all``."""
    for index in range(50):
        s = task.sample(seed=3, index=index)
        tokens, labels = s["tokens"].tolist(), s["labels"].tolist()
        raw = raw_of(s)
        first, every = s["induction_first"], s["induction_all"]
        assert first.sum() == 1 and every.sum() >= 1
        p1 = int(np.flatnonzero(first)[0])
        assert p1 == int(np.flatnonzero(every)[0])
        assert (s["predict_mask"] == first).all()
        assert len(set(raw[:p1])) == p1  # distinct before the first repeat
        assert raw[:p1].count(raw[p1]) == 1
        for p in np.flatnonzero(every).tolist():
            i = latest_before(raw, p)
            assert i is not None, (index, p)
            assert labels[p] == tokens[p + 1] if p + 1 < len(tokens) else True
            assert labels[p] == raw[i + 1]
            assert s["loss_mask"][p] == 1
        # no token twice in a row; ids in (mid_val, max_val); at most pool distinct ids
        assert all(a != b for a, b in zip(raw, raw[1:]))
        assert all(task.mid_val < t < task.max_val for t in raw)
        pool = task.pool_size or task.length or task.seq_length
        assert len(set(raw)) <= pool


def test_strict_variant_holds_the_rule_of_section_3_2_everywhere():
    """§3.2: whenever token j equals an earlier token i, token j+1 equals token
    i+1 - for every pair (the sequence is periodic after its first repeat)."""
    task = InductionTask(seq_length=64, max_val=200, variant="strict")
    for index in range(50):
        s = task.sample(seed=0, index=index)
        raw = raw_of(s)
        for j in range(len(raw) - 1):
            for i in range(j):
                if raw[i] == raw[j]:
                    assert raw[j + 1] == raw[i + 1], (index, i, j)
        p1 = int(np.flatnonzero(s["induction_first"])[0])
        assert s["induction_all"][p1:].all() and not s["induction_all"][:p1].any()


def test_the_rule_holds_for_every_repeat_drawn_by_the_default_variant():
    """The default variant: whenever token j is a repeat (not itself a copy),
    token j+1 is the token after its latest earlier occurrence."""
    for index in range(30):
        s = SMALL.sample(seed=1, index=index)
        raw = raw_of(s)
        every = set(np.flatnonzero(s["induction_all"]).tolist())
        copies = {p + 1 for p in every}
        for j in range(1, len(raw) - 1):
            i = latest_before(raw, j)
            if i is not None and j not in copies:
                assert j in every and raw[j + 1] == raw[i + 1]


def test_framing_and_padding():
    task = InductionTask(seq_length=48, length=30, max_val=100)
    s = task.sample(0, 0)
    assert s["tokens"].dtype == np.int64 and s["labels"].dtype == np.int64
    assert s["loss_mask"].dtype == np.float32 and s["induction_all"].dtype == bool
    assert (s["position_ids"] == np.arange(48)).all()
    assert (s["labels"][:-1] == s["tokens"][1:]).all()
    assert s["loss_mask"][:29].all() and not s["loss_mask"][29:].any()
    assert (s["tokens"][30:] == PAD).all() and (s["labels"][29:] == PAD).all()
    assert not s["induction_all"][29:].any()
    for k in ("tokens", "labels", "loss_mask", "position_ids", "induction_first",
              "induction_all", "predict_mask"):
        assert s[k].shape == (48,)


def test_deterministic_by_seed_and_index_in_any_order():
    a = [SMALL.sample(5, i)["tokens"] for i in (0, 1, 2)]
    b = [SMALL.sample(5, i)["tokens"] for i in (2, 1, 0)][::-1]
    for x, y in zip(a, b):
        assert (x == y).all()
    assert not (a[0] == a[1]).all()
    assert not (SMALL.sample(6, 0)["tokens"] == a[0]).all()
    ds = SyntheticDataset(SMALL, 10, seed=5)
    assert (ds[2]["tokens"].numpy() == a[2]).all()
    assert ds.batch([0, 1, 2])["tokens"].shape == (3, 64)


def test_fixed_evaluation_set():
    train1, eval1 = train_and_eval(SMALL, 100, 16, seed=0)
    train2, eval2 = train_and_eval(SMALL, 100, 16, seed=0)
    e1, e2 = eval1.batch(range(16)), eval2.batch(range(16))
    for k in e1:
        assert (e1[k] == e2[k]).all()
    t = train1.batch(range(16))
    assert not (t["tokens"] == e1["tokens"]).all(dim=1).any()  # eval is not in training
    assert eval1.seed != train1.seed
    with pytest.raises(ValueError):
        train_and_eval(SMALL, 10, 10, seed=3, eval_seed=3)


def test_streams_are_separated_by_task():
    a = sample_rng("induction", 0, 0).integers(0, 1 << 30, 4)
    b = sample_rng("ngram", 0, 0).integers(0, 1 << 30, 4)
    assert not (a == b).all()


def test_a_length_with_no_room_for_a_scored_repeat_is_refused():
    """The first repeat comes at position 2 at the earliest and needs its label
    after it: 3 tokens never hold one, and "regenerate until one does" looped
    forever (kvtrain experiment --set data.induction.length=3 hung in its checks)."""
    for variant in ("appk", "strict"):
        with pytest.raises(ValueError, match="length must be >= 4, got 3"):
            appk_sequence(np.random.default_rng(0), 3, 10, 50, pool_size=3, variant=variant)
    raw, predict = appk_sequence(np.random.default_rng(0), 4, 10, 50, pool_size=2)
    assert raw[:3] == [raw[0], raw[1], raw[0]] and predict == [2]


def test_bad_arguments():
    with pytest.raises(ValueError):
        appk_sequence(np.random.default_rng(0), 64, 10, 50)  # pool 64 > 39 ids
    with pytest.raises(ValueError):
        build_task("nope", 16)


# ----------------------------------------------------------------------------- 3-gram (App. E.3)
def test_ngram_table_is_a_true_3gram():
    pairs, x3 = ngram_table(200, 32, 10, seed=0)
    assert pairs.shape == (200, 2) and x3.shape == (200,)
    assert len({tuple(p) for p in pairs.tolist()}) == 200
    assert pairs.min() >= 11 and pairs.max() <= 42 and x3.min() >= 11 and x3.max() <= 42
    # x3 is not a function of x2 alone (nor of x1 alone)
    by_x2, by_x1 = {}, {}
    for (a, b), c in zip(pairs.tolist(), x3.tolist()):
        by_x2.setdefault(b, set()).add(c)
        by_x1.setdefault(a, set()).add(c)
    assert any(len(v) > 1 for v in by_x2.values())
    assert any(len(v) > 1 for v in by_x1.values())


def test_ngram_samples_and_masks():
    task = NgramTask(seq_length=61, num_pairs=200, num_symbols=32)
    pairs, x3 = task.table()
    lookup = {tuple(p): c for p, c in zip(pairs.tolist(), x3.tolist())}
    for index in range(20):
        s = task.sample(seed=0, index=index)
        tokens, labels = s["tokens"].tolist(), s["labels"].tolist()
        every, first = s["ngram_all"], s["ngram_first"]
        assert every.sum() == len(range(1, 61, 3))
        assert (np.flatnonzero(every) % 3 == 1).all()
        assert not (first & ~every).any() and (s["predict_mask"] == first).all()
        seen = set()
        for p in np.flatnonzero(every).tolist():
            pair = (tokens[p - 1], tokens[p])
            assert labels[p] == lookup[pair]
            assert first[p] == (pair not in seen)
            seen.add(pair)
        assert s["loss_mask"].all()
        assert max(tokens) < task.vocab_size
    # the table is the task: the same for every sample seed
    assert (NgramTask(seq_length=61).table()[0] == pairs).all()
    assert not (NgramTask(seq_length=61, table_seed=1).table()[0] == pairs).all()


@pytest.mark.parametrize("preset, sets, error", [
    # the window was too short, not data.induction.length (the user never set it; before:
    # "data.induction: length must be >= 4, got 3", naming a key that was not the cause)
    ("fig1a", ["train.seq_length=2"], "train.seq_length (2) must be >= 3 for data.type "
                                      "induction"),
    ("fig1a", ["train.seq_length=2", "data.induction.length=64"],
     "train.seq_length (2) must be >= 3 for data.type induction"),
    # one position holds no x2: every validation's accuracy was NaN, said nowhere
    ("ngram", ["train.seq_length=1"], "train.seq_length (1) must be >= 2 for data.type ngram"),
])
def test_a_window_too_short_to_score_a_position_names_train_seq_length(preset, sets, error):
    from kvtrain.config import ConfigError
    from kvtrain.experiments.presets import arm_configs

    with pytest.raises(ConfigError) as e:
        arm_configs(preset, "cpu", sets)
    assert error in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_length_longer_than_the_window_is_refused_not_cut():
    """data.induction.length is the tokens a sequence is generated with: a length
    above train.seq_length + 1 was cut to the window, silently, and kept as the pool
    (``--set data.induction.length=256`` at the cpu preset's seq_length 128 trained on
    129-token sequences from a pool of 256: neither setting asked for). The window's
    own length and a shorter one (0-padded) are as before."""
    from kvtrain.config import ConfigError
    from kvtrain.experiments.presets import arm_configs

    with pytest.raises(ConfigError) as e:
        arm_configs("fig1a", "cpu", ["data.induction.length=256"])
    message = str(e.value)
    assert "data.induction.length (256) exceeds train.seq_length + 1 (129)" in message, message
    assert "\n" not in message
    for length in (129, 64):
        cfg = arm_configs("fig1a", "cpu", [f"data.induction.length={length}"])[0][1]
        assert cfg.data.induction.length == length
    # a longer sequence: the window with it
    cfg = arm_configs("fig1a", "cpu", ["data.induction.length=256", "train.seq_length=255"])[0][1]
    assert cfg.train.seq_length == 255
