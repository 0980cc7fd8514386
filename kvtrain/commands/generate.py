"""``kvtrain generate RUN_DIR|CHECKPOINT --prompt TEXT | --prompts FILE``.

Greedy by default; ``--temperature T [--top-p P] [--top-k K] [--seed S]``
samples. One process, or ``torchrun --nproc-per-node N`` for tensor
parallelism N (every rank runs the command; rank 0 prints and writes
``--out``). The checkpoint may come from any TP/PP/DP layout. Bad input is
one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text from a run's checkpoint (batched, TP under torchrun)",
        description="Generate continuations of prompts with a kvtrain checkpoint "
                    "(megatron static-batching inference).")
    p.add_argument("source", metavar="RUN_DIR|CHECKPOINT",
                   help="a run folder (its latest complete checkpoint) or one iter_* folder")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeatable); without a tokenizer: token ids separated by spaces")
    p.add_argument("--prompts", metavar="FILE",
                   help="prompts: one per line, or FILE.jsonl with {\"prompt\": ...} per line")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0: no top-k cut")
    p.add_argument("--seed", type=int, default=1234,
                   help="sampling seed (prompt i: a stream of its own from (seed, i))")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per static batch")
    p.add_argument("--no-stop-at-eod", dest="stop_at_eod", action="store_false",
                   help="keep generating past the end-of-document token")
    p.add_argument("--no-eod-prefix", dest="prefix_eod", action="store_false", default=None,
                   help="do not feed the end-of-document token before each prompt "
                        "(default: feed it, so that the prompt starts a document as in "
                        "training, unless the run separated documents: then a document "
                        "never saw the EOD before it)")
    p.add_argument("--tokenizer", metavar="MODEL",
                   help="sentencepiece model (default: the run's data.tokenizer)")
    p.add_argument("--backend", default="auto", choices=["auto", "te", "torch", "local"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--out", metavar="FILE.jsonl", help="also write one JSON object per prompt")
    p.set_defaults(func=run)


def _options(args: argparse.Namespace):
    from kvtrain.inference.generate import SamplingOptions

    return SamplingOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                           stop_at_eod=args.stop_at_eod).check()


def _print(results, loaded, dtype: str) -> None:
    print(f"kvtrain generate: {loaded.checkpoint} (iteration {loaded.iteration}, "
          f"{loaded.config.model.attention}, backend {loaded.backend}, {dtype})", flush=True)
    for n, g in enumerate(results, 1):
        print(f"--- [{n}] {g.prompt}", flush=True)
        print(f"{g.text}", flush=True)
        print(f"--- [{n}] {len(g.tokens)} tokens, stop: {g.stop}", flush=True)


# the fields _write gives every record (Generation.record's, then the run's): a JSONL
# prompt's own field of one of these names would be overwritten there
OUT_FIELDS = ("prompt", "prompt_tokens", "tokens", "text", "stop", "checkpoint", "iteration",
              "temperature", "top_p", "top_k", "seed", "backend", "dtype", "tensor_parallel")


def _write(path: str, results, loaded, options, dtype: str, world: int) -> None:
    from data_tools.fileio import atomic_write_text

    # what made each generation: the resolved backend and the dtype decide its last bits
    meta = {"checkpoint": str(loaded.checkpoint), "iteration": loaded.iteration,
            "temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k,
            "seed": options.seed, "backend": loaded.backend, "dtype": dtype,
            "tensor_parallel": world}
    text = "".join(json.dumps({**g.record(), **meta}) + "\n" for g in results)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, text)
    print(f"kvtrain generate: wrote {len(results)} generations to {path}", flush=True)


def check_out(path: str | None) -> None:
    """--out must be writable, known before the model is loaded and the prompts
    generated: its folder is made now, and a file is made (and removed) in it."""
    import tempfile

    from data_tools.fileio import file_in_the_way
    from kvtrain.config import ConfigError

    if path is None:
        return
    if os.path.isdir(path):
        raise ConfigError(f"--out {path} is a folder, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    if blocker := file_in_the_way(folder):
        raise ConfigError(f"--out {path}: {blocker} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"--out {path} cannot be written in {folder}: "
                          f"{e.strerror or e}") from None


def check_tensor_parallel(cfg, world: int) -> None:
    """Every rank is a tensor-parallel rank: the heads and KV heads must split evenly."""
    from kvtrain.config import ConfigError

    m = cfg.model
    groups = m.kv_heads
    if m.num_attention_heads % world or groups % world:
        raise ConfigError(f"generation runs every rank as a tensor-parallel rank: the model's "
                          f"{m.num_attention_heads} heads / {groups} KV heads do not divide by "
                          f"{world} ranks")


def load_on_every_rank(source: str, backend: str, dtype: str):
    """The checkpoint ``source`` names, on this process's tensor-parallel rank: one
    process, or every rank of ``torchrun`` a TP rank (``dtype``: fp32 | bf16)."""
    import torch

    from kvtrain.config import launched_world_size
    from kvtrain.inference.loading import (find_checkpoint, inference_process, load_model,
                                           saved_config)

    world = launched_world_size()
    # a bad source or a TP size the model cannot split: one line, before the process group
    check_tensor_parallel(saved_config(find_checkpoint(source))[0], world)
    inference_process(tensor=world)  # every rank is a tensor-parallel rank
    return load_model(source, backend=backend,
                      dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)


def run(args: argparse.Namespace) -> int:
    # Everything a user can get wrong is checked before torch/megatron are imported.
    from kvtrain.config import ConfigError, launched_world_size
    from kvtrain.inference.generate import read_prompts

    options = _options(args)
    prompts = read_prompts(args.prompt, args.prompts, written=OUT_FIELDS if args.out else ())
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT or --prompts FILE")
    check_out(args.out)
    from kvtrain.commands.train import quiet_imports

    quiet_imports()
    import torch

    from kvtrain.inference.generate import PromptCodec, generate

    world = launched_world_size()
    loaded = load_on_every_rank(args.source, args.backend, args.dtype)
    codec = PromptCodec.for_run(loaded.config, args.tokenizer)
    results = generate(loaded.model, loaded.config, codec, prompts, options,
                       batch_size=args.batch_size, prefix_eod=args.prefix_eod)
    if torch.distributed.get_rank() == 0:
        _print(results, loaded, args.dtype)
        if args.out:
            _write(args.out, results, loaded, options, args.dtype, world)
    sys.stdout.flush()
    return 0
