"""Cost of KV shifting attention against vanilla attention, same model otherwise.

Times forward+backward of a GPT model (and peak memory on GPU) for both
variants in this process, alternating them so that machine noise hits both,
and prints the ratios. On a GPU it runs with the Transformer Engine spec when
TE is installed (bf16), otherwise the local spec on the CPU (fp32).

    .venv/bin/python benchmarks/kv_shift_overhead.py [--hidden 512 --layers 4 --seq 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(attention: str, args):
    from kvtrain.config import ModelConfig
    from kvtrain.model.builder import Numerics, build_gpt, transformer_config

    cfg = ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.seq, attention=attention,
    )
    numerics = Numerics.from_precision("auto")
    model = build_gpt(cfg, transformer_config(cfg, numerics=numerics), seed=0)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def step(model, tokens, pos):
    loss = model(tokens, pos, None, labels=tokens)
    loss.float().mean().backward()
    model.zero_grad(set_to_none=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    from kvtrain.backend import init_distributed
    from kvtrain.model.specs import resolve_backend

    init_distributed(seed=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {a: build(a, args) for a in ("vanilla", "kv_shift")}
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    pos = torch.arange(args.seq, device=device)[None].expand_as(tokens)
    for model in models.values():
        for _ in range(args.warmup):
            step(model, tokens, pos)
    times = {a: [] for a in models}
    peak = {}
    for _ in range(args.iters):
        for name, model in models.items():  # alternate: noise hits both
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            step(model, tokens, pos)
            sync()
            times[name].append(time.perf_counter() - t0)
            if device == "cuda":
                peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated())
    tokens_per_step = args.batch * args.seq
    print(f"device={device} backend={resolve_backend()} hidden={args.hidden} layers={args.layers} "
          f"heads={args.heads} kv_heads={args.kv_heads} seq={args.seq} batch={args.batch}")
    med = {a: statistics.median(t) for a, t in times.items()}
    for name in models:
        line = f"{name:9s} fwd+bwd median {med[name] * 1e3:8.1f} ms  {tokens_per_step / med[name]:9.0f} tok/s"
        if peak:
            line += f"  peak {peak[name] / 2**20:8.1f} MiB"
        print(line)
    print(f"time ratio kv_shift/vanilla: {med['kv_shift'] / med['vanilla']:.3f}")
    if peak:
        print(f"peak-memory ratio kv_shift/vanilla: {peak['kv_shift'] / peak['vanilla']:.3f}")


if __name__ == "__main__":
    main()
