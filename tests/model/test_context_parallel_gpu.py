"""The CP pieces that fit one GPU: the KV-shift halo and the torch backend's CP
attention, with 2 ranks sharing the card (``gpu`` tests).

NCCL refuses two ranks on one device ("Duplicate GPU detected"), so the two
ranks talk over gloo, which stages CUDA tensors through the host for its
all-gather and (all-reduce based) reduce-scatter; the math runs on the GPU.
The cases are those of the CPU tests (``test_context_parallel.py``).
"""

from __future__ import annotations

import pytest
import torch

from kvtrain.testing import run_distributed

from .test_context_parallel import attention_case, halo_case

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _rank(rank: int, world: int) -> dict:
    from megatron.core import parallel_state

    from kvtrain.backend import init_model_parallel

    init_model_parallel(context=world)
    group = parallel_state.get_context_parallel_group()
    halo = {(w, d): halo_case(group, w, d, "cuda") for w in (1, 2) for d in (False, True)}
    attention = {d: attention_case(group, d, "cuda") for d in (False, True)}
    cpu = lambda r: {k: tuple(t.cpu() for t in v) for k, v in r.items()}  # noqa: E731
    return {"halo": {k: cpu(v) for k, v in halo.items()},
            "attention": {k: cpu(v) for k, v in attention.items()}}


@pytest.fixture(scope="module")
def two_ranks_one_gpu():
    # kvtrain.testing's loop: results as bytes (no shared-memory handles that die with
    # a rank), a deadline and a dead rank noticed (no hang on an NCCL/CUDA abort)
    return run_distributed(_rank, 2, timeout=300, one_gpu=True)


def test_halo_on_gpu(two_ranks_one_gpu):
    for per_rank in two_ranks_one_gpu:
        for key, result in per_rank["halo"].items():
            out, ref = result["out"]
            assert torch.equal(out, ref), key
            for name in ("math", "x_grad", "coef_grad"):
                torch.testing.assert_close(*result[name], atol=1e-6, rtol=1e-6,
                                           msg=f"{key} {name}")


def test_torch_cp_attention_on_gpu(two_ranks_one_gpu):
    for per_rank in two_ranks_one_gpu:
        for docs, result in per_rank["attention"].items():
            for name, (mine, ref) in result.items():
                # GPU SDPA kernels differ between the chunked and the full call
                torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4,
                                           msg=f"{docs} {name}")
