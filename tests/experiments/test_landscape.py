"""Figure 2 (``kvtrain experiment landscape``): Theorem 3.4's loss over the tied
coefficients, checked against the paper's Eq. (14) written out by hand, and what the
figure shows: the induction head (0, 1) is the minimum, the lines thin out as O(T)
grows, and descent from the paper's initialisation ends there (or, at small O(T),
at the other corner)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvtrain.cli import main
from kvtrain.experiments.landscape import descend, grid, panel, theorem_loss


def eq14(alpha1: float, beta1: float, rest: float) -> float:
    """Eq. (14) with Table 3's logits, term by term."""
    alpha2, beta2 = 1 - alpha1, 1 - beta1
    s = math.exp(alpha2) + 2 * math.exp(alpha1) + rest
    a1, a2 = math.exp(alpha1) / s, math.exp(alpha2) / s
    logits = {"i+1": (beta1 * math.exp(alpha2) + beta2) / s,
              "i-1": (beta1 + beta2 * math.exp(alpha2)) / s,
              "T": (beta1 + beta2 * math.exp(alpha2)) / s,
              "i": (2 * beta1 * math.exp(alpha1) + beta2 * math.exp(alpha2)) / s}
    assert math.isclose(logits["i+1"], a2 * beta1 + beta2 / s)
    assert math.isclose(logits["i"], 2 * a1 * beta1 + a2 * beta2)
    total = sum(math.exp(v) for v in logits.values()) + rest
    return -math.log(math.exp(logits["i+1"]) / total)


@pytest.mark.parametrize("alpha1, beta1, rest", [(0.3, 0.7, 0.0), (0.9, 0.1, 10.0),
                                                 (0.0, 1.0, 100.0), (0.5, 0.5, 3.5)])
def test_the_loss_is_eq14(alpha1, beta1, rest):
    got = theorem_loss(torch.tensor(alpha1, dtype=torch.float64),
                       torch.tensor(beta1, dtype=torch.float64), rest)
    assert float(got) == pytest.approx(eq14(alpha1, beta1, rest), rel=1e-12)


def test_the_descent_directions_are_the_negative_gradient():
    a, b, loss, da, db = grid(11, 10.0)
    h = 1e-6
    for i, j in ((3, 4), (7, 2), (5, 5)):
        x, y = float(a[i, j]), float(b[i, j])  # [beta1, alpha1] indexing
        assert float(loss[i, j]) == pytest.approx(eq14(x, y, 10.0), rel=1e-12)
        assert float(da[i, j]) == pytest.approx(
            -(eq14(x + h, y, 10.0) - eq14(x - h, y, 10.0)) / (2 * h), rel=1e-5, abs=1e-9)
        assert float(db[i, j]) == pytest.approx(
            -(eq14(x, y + h, 10.0) - eq14(x, y - h, 10.0)) / (2 * h), rel=1e-5, abs=1e-9)


def test_the_induction_head_is_the_minimum_and_the_lines_thin_out_as_the_rest_grows():
    panels = [panel(rest, points=51, starts=32) for rest in (0.0, 10.0, 100.0)]
    for p in panels:
        assert p.argmin == (0.0, 1.0) and p.loss_min == pytest.approx(p.loss_at_induction)
    ranges = [p.loss_max - p.loss_min for p in panels]
    assert ranges[0] > ranges[1] > ranges[2] > 0  # fewer contour lines: slower descent
    # descent from U(0, 1)^2: at O(T) = 0 a share ends at the corner (1, 0), none at 100
    assert 0.4 < panels[0].descent_ends_near_induction < 0.9
    assert set(panels[0].other_ends) == {"1.00,0.00"}
    assert panels[2].descent_ends_near_induction == 1.0 and panels[2].other_ends == {}


def test_descent_stays_in_the_square():
    ends = descend(torch.tensor([[0.99, 0.01], [0.02, 0.97]]), 0.0, lr=5.0, steps=50)
    assert ends.min() >= 0 and ends.max() <= 1
    assert ends.tolist() == [[1.0, 0.0], [0.0, 1.0]]


def test_the_command_writes_the_figure_and_what_it_shows(tmp_path, capsys):
    assert main(["experiment", "landscape", "--rest", "0,100", "--run-dir",
                 str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'out'}/landscape.png" in out
    png = (tmp_path / "out" / "landscape.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    panels = json.loads((tmp_path / "out" / "landscape.json").read_text())["panels"]
    assert [p["rest"] for p in panels] == [0.0, 100.0]
    assert all(p["argmin"] == [0.0, 1.0] for p in panels)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["landscape.json",
                                                                   "landscape.png"]


def test_a_rest_past_float64s_precision_is_one_line(tmp_path, capsys):
    """The loss differs by ~1/O(T) across the landscape: past 1e12 that is below
    float64's precision beside log O(T); 1e20 put the minimum at (0, 0), 1e50 wrote
    Infinity into landscape.json (not JSON; a probe's)."""
    assert main(["experiment", "landscape", "--rest", "0,1e20", "--run-dir",
                 str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvtrain: config error: --rest '0,1e20': O(T) above 1e+12 leaves the landscape's "
        "differences (~1/O(T)) below float64's precision")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rest", ["", "0,-1", "nan", "a,b"])
def test_a_bad_rest_is_one_line_and_writes_nothing(tmp_path, capsys, rest):
    assert main(["experiment", "landscape", "--rest", rest, "--run-dir",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rest" in err[0] and "give finite O(T) values >= 0" in err[0]
    assert not (tmp_path / "out").exists()
