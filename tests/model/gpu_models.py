"""What the ``gpu`` tests of kvtrain's fused kernels share: the same small model on the
GPU with a fused path (``rope_fusion``) and without, fp32 and bf16, compared in
logits and every gradient, the fused node counted in the graph."""

from __future__ import annotations

import torch


def assert_fused_matches(attention: str, backend: str, node: str, nodes: int,
                         seq: int = 128) -> None:
    """A 2-layer model (GQA 8/4) built with and without ``rope_fusion``: ``nodes``
    autograd nodes named ``node`` with it, none without, and the logits and every
    gradient within each dtype's rounding (fp32 1e-4, bf16 5e-2 of scale)."""
    from megatron.core.transformer.module import Float16Module

    from kvtrain.backend import set_seed
    from kvtrain.config import ModelConfig
    from kvtrain.model.builder import Numerics, build_gpt, transformer_config

    from .interpreter import autograd_nodes

    tokens = torch.randint(0, 256, (2, seq), device="cuda")
    pos = torch.arange(seq, device="cuda")[None].expand_as(tokens)
    for numerics, tol in ((Numerics(), 1e-4), (Numerics.from_precision("bf16"), 5e-2)):
        runs = {}
        for fusion in (True, False):
            set_seed(3)
            cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8,
                              num_query_groups=4, vocab_size=256,
                              max_position_embeddings=seq, attention=attention)
            tc = transformer_config(cfg, numerics=numerics, rope_fusion=fusion)
            model = build_gpt(cfg, tc, backend=backend).cuda()
            if numerics.bf16:
                model = Float16Module(tc, model)
            out = model(tokens, pos, None).float()
            out.pow(2).mean().backward()
            count = sum(n == node for n in autograd_nodes(out))
            runs[fusion] = (out.detach(), {n: p.grad.float() for n, p in model.named_parameters()},
                            count)
        (out_f, grads_f, n_f), (out_r, grads_r, n_r) = runs[True], runs[False]
        assert (n_f, n_r) == (nodes, 0), (attention, numerics)
        assert (out_f - out_r).abs().max() <= tol * out_r.abs().max(), (attention, numerics)
        for name, g in grads_r.items():
            assert (grads_f[name] - g).abs().max() <= tol * g.abs().max(), (name, numerics)
