"""Bytes that autograd keeps for backward after one attention layer's forward
(fp32, CPU; ``--backend torch``, SDPA, by default, or ``local``): vanilla
attention, KV shift through the reference ``shift_tokens`` (ordinary ops), and
KV shift through each CPU kernel (``model.kv_shift.kernel``: torch ops, the
native operators). Counted per storage (views of one tensor count once),
parameters excluded; also the number of tensors saved, and the bytes against
vanilla's.

    .venv/bin/python benchmarks/shift_saved_bytes.py [--backend torch|local] [--seq 256 --batch 2 --hidden 256 --heads 8 --groups 4]
"""

from __future__ import annotations

import argparse

import torch

import kvtrain.model.kv_shift as kv_shift_module
from kvtrain.backend import init_distributed, init_model_parallel, set_seed
from kvtrain.config import ModelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.builder import build_gpt, transformer_config
from kvtrain.model.kv_shift import shift_tokens
from kvtrain.model.shift_kernels import fused_shift, fused_shift_qkv


def reference_shift(x, coef, doc_ids=None, impl=None):
    return shift_tokens(x, coef, doc_ids)


def reference_qkv(mixed, coef_k, coef_v, doc_ids=None, query_width=0, impl=None):
    d = (mixed.shape[-1] - query_width) // 2
    q, k, v = mixed.split([query_width, d, d], dim=-1)
    return q, shift_tokens(k, coef_k, doc_ids), shift_tokens(v, coef_v, doc_ids)


def saved(attn: torch.nn.Module, hidden: torch.Tensor, mask: torch.Tensor,
          rope: torch.Tensor) -> tuple[int, int]:
    """(bytes of the distinct storages saved, number of tensors saved) by one forward."""
    storages: dict[int, int] = {}
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()  # a saved output itself would keep its graph (and groups) alive

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(hidden, mask, rotary_pos_emb=rope)  # RoPE: Q and K attention saves are new tensors
    params = {p.untyped_storage().data_ptr() for p in attn.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params), count


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("seq", 256), ("batch", 2), ("hidden", 256), ("heads", 8), ("groups", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--backend", choices=("torch", "local"), default="torch")
    args = p.parse_args(argv)
    init_distributed(seed=1)
    init_model_parallel(1, 1)
    set_seed(1)
    s = args.seq
    causal = ~torch.ones(s, s, dtype=torch.bool).tril()[None, None]  # True = masked
    packed = causal.clone()
    for start in (s // 3, 2 * s // 3):  # three documents
        packed[..., start:, :start] = True
    d = args.hidden // args.heads
    tokens = s * args.batch
    print(f"one attention layer, {args.backend} backend, fp32: s={s} b={args.batch} "
          f"hidden={args.hidden} heads={args.heads} kv_groups={args.groups}; one K or V = "
          f"{tokens * args.groups * d * 4} B, QKV output = "
          f"{tokens * (args.heads + 2 * args.groups) * d * 4} B")
    hidden = torch.randn(s, args.batch, args.hidden, requires_grad=True)
    vanilla: dict[str, int] = {}
    for attention, kernel in (("vanilla", "-"), ("kv_shift", "shift_tokens"),
                              ("kv_shift", "torch"), ("kv_shift", "native")):
        cfg = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                          num_query_groups=args.groups, vocab_size=128, max_position_embeddings=s,
                          attention=attention, backend=args.backend,
                          kv_shift=KVShiftConfig(kernel="torch" if kernel == "-" else
                                                 "auto" if kernel == "shift_tokens" else kernel))
        model = build_gpt(cfg, transformer_config(cfg), backend=args.backend)
        attn = model.decoder.layers[0].self_attention
        if kernel == "shift_tokens":  # the module's two call sites
            kv_shift_module.fused_shift, kv_shift_module.fused_shift_qkv = (reference_shift,
                                                                           reference_qkv)
        try:
            for mask_name, mask in (("causal", causal), ("3 docs", packed)):
                nbytes, count = saved(attn, hidden, mask, model.rotary_pos_emb(s))
                vanilla.setdefault(mask_name, nbytes)
                print(f"  {attention:8s} {kernel:12s} {mask_name:6s} {nbytes:>10d} B in "
                      f"{count:3d} tensors ({nbytes / vanilla[mask_name]:.3f} x vanilla)")
        finally:
            kv_shift_module.fused_shift, kv_shift_module.fused_shift_qkv = (fused_shift,
                                                                           fused_shift_qkv)


if __name__ == "__main__":
    main()
