"""Figure 2 of the paper: how gradient descent moves KV shifting's coefficients towards
an induction head, in the simplified model of Theorem 3.4.

The setting (Section 3.2, Appendix C): one layer, no residual, MLP, normalisation or
positions, tied embeddings of i.i.d. N(0, 1/d) entries, identity projections, a
sequence of T + 1 tokens whose last repeats one earlier token, the loss only on the
last prediction, d -> infinity, and the coefficients tied (alpha2 = 1 - alpha1,
beta2 = 1 - beta1). The loss is then Eq. (14), with Appendix C's Table 3 logits:

    L = -log( e^t / (e^t + 2 e^n1 + e^n2 + O(T)) ),
    t  = a2 beta1 + beta2 / S        (the answer, token i + 1)
    n1 = beta1 / S + beta2 a2        (tokens i - 1 and T)
    n2 = 2 a1 beta1 + a2 beta2       (token i)
    a1 = e^alpha1 / S, a2 = e^alpha2 / S, S = e^alpha2 + 2 e^alpha1 + O(T)

with O(T) >= 0 the rest of the sequence, taken as a constant. The induction head is
(alpha1, beta1) = (0, 1): the key of the token before, the value of the token itself.
(Appendix L's plotting code differs from Eq. (14) in two places: ``exp(ot)`` where the
equation adds O(T), and ``a2 + beta2`` where Table 3 has ``a2 beta2``; this module
follows the equation, whose O(T) = 100 panel the code's exp(100) could not draw.)

``kvtrain experiment landscape`` draws the contour lines and the descent directions
for each O(T) (``landscape.png``) and writes what the figure shows (``landscape.json``):
where the minimum is, the loss's range (the lines thin out as O(T) grows: slower
convergence), and where plain gradient descent from the paper's initialisation
(alpha1, beta1 ~ U(0, 1)) goes.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

INDUCTION = (0.0, 1.0)  # (alpha1, beta1) of an induction head


def theorem_loss(alpha1: Tensor, beta1: Tensor, rest: float) -> Tensor:
    """Eq. (14) at ``(alpha1, beta1)`` (tied: alpha2 = 1 - alpha1, beta2 = 1 - beta1),
    elementwise; ``rest``: O(T) >= 0."""
    alpha2, beta2 = 1 - alpha1, 1 - beta1
    s = torch.exp(alpha2) + 2 * torch.exp(alpha1) + rest
    a1, a2 = torch.exp(alpha1) / s, torch.exp(alpha2) / s
    answer = a2 * beta1 + beta2 / s
    before = beta1 / s + beta2 * a2  # tokens i - 1 and T
    repeated = 2 * a1 * beta1 + a2 * beta2  # token i
    total = torch.exp(answer) + 2 * torch.exp(before) + torch.exp(repeated) + rest
    return torch.log(total) - answer


def grid(points: int, rest: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(alpha1, beta1, loss, -dL/dalpha1, -dL/dbeta1)`` on a ``points`` x ``points``
    grid of [0, 1]^2 (``[beta1, alpha1]`` indexing, as matplotlib's contour takes it)."""
    axis = torch.linspace(0, 1, points, dtype=torch.float64)
    b, a = torch.meshgrid(axis, axis, indexing="ij")
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    loss = theorem_loss(a, b, rest)
    da, db = torch.autograd.grad(loss.sum(), (a, b))
    return a.detach(), b.detach(), loss.detach(), -da, -db


def descend(starts: Tensor, rest: float, lr: float = 1.0, steps: int = 1000) -> Tensor:
    """Where plain gradient descent on Eq. (14) from each row ``(alpha1, beta1)`` of
    ``starts [n, 2]`` ends, the coefficients kept in [0, 1] (the figure's square)."""
    point = starts.clone().to(torch.float64)
    for _ in range(steps):
        point.requires_grad_()
        (grad,) = torch.autograd.grad(theorem_loss(point[:, 0], point[:, 1], rest).sum(), point)
        point = (point.detach() - lr * grad).clamp_(0, 1)
    return point


@dataclass
class Panel:
    """What one O(T) panel shows."""

    rest: float  # O(T)
    loss_min: float
    argmin: tuple[float, float]  # (alpha1, beta1) of the grid's minimum
    loss_max: float
    loss_at_induction: float
    descent_ends_near_induction: float  # of the starts from U(0, 1)^2, within 0.05
    other_ends: dict[str, int]  # where the other starts end ("alpha1,beta1" to 2 places)


def panel(rest: float, points: int = 201, starts: int = 64, seed: int = 0) -> Panel:
    a, b, loss, _, _ = grid(points, rest)
    i = int(loss.argmin())
    generator = torch.Generator().manual_seed(seed)
    inits = torch.rand(starts, 2, generator=generator, dtype=torch.float64)  # paper's U(0, 1)
    ends = descend(inits, rest)
    close = (ends - torch.tensor(INDUCTION, dtype=ends.dtype)).abs().amax(dim=1) <= 0.05
    others: dict[str, int] = {}
    for x, y in ends[~close].tolist():
        others[f"{x:.2f},{y:.2f}"] = others.get(f"{x:.2f},{y:.2f}", 0) + 1
    at = theorem_loss(torch.tensor(INDUCTION[0]), torch.tensor(INDUCTION[1]), rest)
    return Panel(rest=rest, loss_min=float(loss.min()),
                 argmin=(float(a.flatten()[i]), float(b.flatten()[i])),
                 loss_max=float(loss.max()), loss_at_induction=float(at),
                 descent_ends_near_induction=int(close.sum()) / starts,
                 other_ends=dict(sorted(others.items(), key=lambda kv: -kv[1])))


def draw(rests: Sequence[float], path: Path, points: int = 201) -> None:
    """Figure 2: per O(T), the contour lines of L (every 0.01) and the descent
    directions -grad L, the induction head marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtrain.output import written_whole

    fig, axes = plt.subplots(1, len(rests), figsize=(4.2 * len(rests), 4), squeeze=False)
    for ax, rest in zip(axes[0], rests):
        a, b, loss, da, db = grid(points, rest)
        low, high = float(loss.min()), float(loss.max())
        levels = torch.arange(low, high + 0.01, 0.01).tolist()
        ax.contour(a.numpy(), b.numpy(), loss.numpy(), levels=levels, colors="black",
                   linewidths=0.4)
        ax.streamplot(a.numpy(), b.numpy(), da.numpy(), db.numpy(), density=0.8,
                      color="tab:blue", linewidth=0.7)
        ax.plot(*INDUCTION, marker="*", markersize=12, color="tab:red", clip_on=False,
                label="induction head")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=r"$\alpha_1$", ylabel=r"$\beta_1$",
               title=f"O(T) = {rest:g}: L in [{low:.3f}, {high:.3f}]")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    # a few colours drawn: a palette PNG is a fifth of the size, the same picture
    image = Image.open(buffer).convert("RGB").quantize(colors=64)
    with written_whole(path, "wb") as f:
        image.save(f, format="png", optimize=True)


def write_landscape(out: Path, rests: Sequence[float]) -> list[Panel]:
    """``out/landscape.png`` and ``out/landscape.json``; the panels."""
    from kvtrain.output import write_whole

    panels = [panel(rest) for rest in rests]
    draw(rests, out / "landscape.png")
    write_whole(out / "landscape.json",
                json.dumps({"panels": [asdict(p) for p in panels]}, indent=1) + "\n")
    return panels


def format_panels(panels: Sequence[Panel]) -> str:
    lines = ["O(T)  min L (at alpha1, beta1)  max L   descent from U(0,1)^2: at (0, 1), "
             "elsewhere"]
    for p in panels:
        elsewhere = ", ".join(f"({k}) {n}" for k, n in p.other_ends.items()) or "-"
        lines.append(f"{p.rest:<5g} {p.loss_min:.4f} ({p.argmin[0]:.2f}, {p.argmin[1]:.2f})"
                     f"{'':9}{p.loss_max:.4f}  {p.descent_ends_near_induction:.0%}, {elsewhere}")
    return "\n".join(lines)


__all__ = ["INDUCTION", "Panel", "descend", "draw", "format_panels", "grid", "panel",
           "theorem_loss", "write_landscape"]
