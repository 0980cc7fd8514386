"""Text generation from a kvtrain checkpoint on megatron's static-batching inference.

The model runs with megatron's ``StaticInferenceContext`` (its KV cache; the
KV-shift layers keep the raw K/V tail of the previous tokens next to it, see
``KVShiftSelfAttention._shift_with_cache``). The loop is megatron's static
batching strategy (``TextGenerationController.generate_all_output_tokens_static_batch``),
driven here directly because that controller needs a CUDA generator and a
megatron tokenizer object:

* the prompts of a batch are aligned at position 0 and padded on the right;
* the first step runs all rows up to the *shortest* prompt (prefill), then one
  token per step: a row whose prompt is not consumed yet is fed its next
  prompt token (the sampled one is dropped), a row past its prompt gets the
  sampled token.

So no padding token ever precedes or sits inside a row's context: every row
sees exactly its own tokens at positions 0, 1, 2, ...: the KV-shift state (the
token before position 0 is zero) and RoPE positions are those of the prompt
run alone, and a batch of prompts of different lengths gives each prompt the
tokens it gets alone (greedy). Left padding would instead put pad tokens before
the prompt, shifting RoPE positions and feeding the pad's K/V into the shift.

Sampling: greedy (``temperature`` 0, the default), or temperature with top-p /
top-k; each prompt has its own random generator seeded from (seed, prompt
index) (``prompt_generator``), so a prompt's sample does not depend on the batch
it runs in, and no two seeds share a prompt's stream. Under
TP every rank computes the same gathered logits; the tokens of TP rank 0 are
broadcast so that all ranks feed the same ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Collection, Optional, Sequence

import torch

from kvtrain.config import ConfigError, RunConfig


@dataclass(frozen=True)
class SamplingOptions:
    """How the next token is chosen, and when a prompt's generation stops."""

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding top_p
    top_k: int = 0  # 0: no top-k cut
    seed: int = 1234
    stop_at_eod: bool = True  # end a prompt's generation at the end-of-document token

    def check(self) -> "SamplingOptions":
        """Itself, or ConfigError naming the bad option."""
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")
        # NaN fails every comparison; inf would sample every token alike, silently
        if not 0 <= self.temperature < float("inf"):
            raise ConfigError(f"--temperature must be >= 0 and finite (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (got {self.top_k})")
        if not -2**63 <= self.seed < 2**63:  # a 64-bit seed, as torch's
            raise ConfigError(f"--seed must be in [-2^63, 2^63) (got {self.seed})")
        if self.temperature == 0 and (self.top_p < 1.0 or self.top_k > 0):
            raise ConfigError("--top-p/--top-k need sampling: set --temperature > 0")
        return self


@dataclass
class Generation:
    """One prompt's result."""

    prompt: str
    prompt_tokens: list[int]  # what the model was fed, the EOD prefix included
    tokens: list[int]  # generated, without the stopping EOD
    text: str  # the generated tokens decoded
    stop: str  # "eod" | "length"
    extra: dict = field(default_factory=dict)  # a JSONL prompt's other fields

    def record(self) -> dict:
        """The JSON object written to ``--out``."""
        return {**self.extra, "prompt": self.prompt, "prompt_tokens": self.prompt_tokens,
                "tokens": self.tokens, "text": self.text, "stop": self.stop}


# ----------------------------------------------------------------------------- prompts and text
class PromptCodec:
    """Text <-> ids with the run's tokenizer; without one (``data.tokenizer: null``)
    a prompt is token ids separated by spaces, and so is the output."""

    def __init__(self, tokenizer, vocab_size: int, eod: int):
        self.tokenizer = tokenizer  # data_tools SentencePieceTokenizer, or None
        self.vocab_size = vocab_size  # ids the tokenizer can produce (< the padded vocab)
        self.eod = eod

    @classmethod
    def for_run(cls, cfg: RunConfig, tokenizer_path: Optional[str] = None) -> "PromptCodec":
        """The codec of a run config; ``tokenizer_path`` overrides ``data.tokenizer``
        (whose path is as the run was given it: relative paths are to its cwd)."""
        from kvtrain.data.tokenizer import VocabOnlyTokenizer, load_tokenizer

        # the trainer's loader and checks, whatever data the run read
        data = replace(cfg.data, type="gpt", tokenizer=tokenizer_path or cfg.data.tokenizer)
        try:
            tok = load_tokenizer(data, cfg.model,
                                 key="--tokenizer" if tokenizer_path else "the run's data.tokenizer")
        except ConfigError as e:
            if tokenizer_path:
                raise
            raise ConfigError(f"{e}; name another with --tokenizer") from None
        if isinstance(tok, VocabOnlyTokenizer):  # no tokenizer: prompts are token ids
            return cls(None, tok.vocab_size, tok.eod)
        return cls(tok, tok.vocab_size, tok.eod)

    def encode(self, text: str, where: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.encode(text)
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ConfigError(f"{where}: the run has no tokenizer (data.tokenizer: null), so a "
                              f"prompt is token ids separated by spaces; got {text[:40]!r}") \
                from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ConfigError(f"{where}: token id {bad[0]} is outside the vocabulary "
                              f"[0, {self.vocab_size})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return " ".join(str(int(i)) for i in ids)


def _utf8(text: str, where: str) -> str:
    """``text``, or ConfigError where it holds a lone surrogate: bytes of an argument
    that are not UTF-8, or a JSON escape such as ``\\udcff`` (the tokenizer cannot take it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({text[e.start]!r} at character "
                          f"{e.start})") from None
    return text


def read_prompts(texts: Sequence[str] = (), file: Optional[str] = None,
                 written: Collection[str] = ()) -> list[tuple[str, dict]]:
    """(prompt, extra fields) of ``--prompt`` values, then of ``--prompts FILE``.

    FILE: ``*.jsonl``: one JSON object per line with a ``prompt`` string (its other
    fields are copied to the output) or one JSON string; any other name: one
    prompt per line, blank lines skipped. ``written``: the fields the output writes
    itself; a prompt's own of those names is refused (it would be overwritten there).
    """
    prompts = [(_utf8(t, f"--prompt {n}"), {}) for n, t in enumerate(texts, 1)]
    if file is None:
        return prompts
    path = Path(file)
    try:
        # utf-8-sig: a byte order mark (Windows editors write one) is not prompt text;
        # a newline ends a line ("\r\n" and "\r" read as one), not each separator
        # str.splitlines knows (U+2028, form feed, ...): they sit inside prompts and
        # inside JSON strings
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts {path}: cannot read ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append((line, {}))
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"--prompts {path} line {n}: not JSON ({e})") from None
        where = f"--prompts {path} line {n}"
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            taken = [k for k in item if k != "prompt" and k in written]
            if taken:
                raise ConfigError(f"{where}: its field \"{taken[0]}\" is one --out writes "
                                  "itself: rename it (its other fields are copied as they are)")
            prompts.append((_utf8(item["prompt"], where),
                            {k: v for k, v in item.items() if k != "prompt"}))
        elif isinstance(item, str):
            prompts.append((_utf8(item, where), {}))
        else:
            raise ConfigError(f"--prompts {path} line {n}: expected a JSON string or an object "
                              f"with a \"prompt\" string")
    if len(prompts) == len(texts):
        raise ConfigError(f"--prompts {path}: no prompt in it (empty or blank lines only)")
    return prompts


# ----------------------------------------------------------------------------- choosing tokens
def _filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` [V] with the tokens outside the top-p nucleus at -inf."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    # keep a token when the mass before it is < top_p: the smallest set holding top_p
    drop = probs.cumsum(-1) - probs >= top_p
    drop[0] = False
    return logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))


def choose_tokens(logits: torch.Tensor, options: SamplingOptions,
                  generators: Sequence[torch.Generator]) -> torch.Tensor:
    """The next token of each row of ``logits`` [b, V] (fp32), [b] int64."""
    # a temperature the logits' dtype rounds to 0 (1e-320 in fp32) is greedy too: the
    # division below would be 0 / 0 for the max (a NaN softmax: multinomial raised)
    if torch.tensor(options.temperature, dtype=logits.dtype) == 0:
        return logits.argmax(-1)
    # the row's max at 0 first: a temperature near 0 then sends the other logits
    # to -inf, rather than the max to inf (and the softmax to NaN)
    scaled = (logits - logits.amax(-1, keepdim=True)) / options.temperature  # [b, V]
    out = []
    for row, gen in zip(scaled, generators):
        if options.top_k:
            kth = torch.topk(row, min(options.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if options.top_p < 1.0:
            row = _filter_top_p(row, options.top_p)
        out.append(torch.multinomial(row.softmax(-1), 1, generator=gen))
    return torch.cat(out)


def prompt_generator(seed: int, index: int) -> torch.Generator:
    """The random generator of prompt ``index``: seeded from (seed, index) by numpy's
    SeedSequence, so that other (seed, index) pairs draw unrelated streams (seed + index
    made seed 2's prompt 0 draw what seed 1's prompt 1 drew)."""
    import numpy as np

    # seed % 2^64: SeedSequence takes no negative entropy; distinct int64 seeds stay distinct
    state = np.random.SeedSequence([seed % 2**64, index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def _same_on_tp_ranks(tokens: torch.Tensor) -> torch.Tensor:
    """TP rank 0's tokens on every TP rank (the ranks must feed the same tokens)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return tokens
    torch.distributed.broadcast(tokens, parallel_state.get_tensor_model_parallel_src_rank(),
                                group=parallel_state.get_tensor_model_parallel_group())
    return tokens


# ----------------------------------------------------------------------------- the loop
@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                 options: SamplingOptions, eod: int, vocab_size: int,
                 first_index: int = 0) -> list[tuple[list[int], str]]:
    """Generates for one batch of token-id prompts: (new tokens, stop reason) each.

    ``vocab_size``: tokens the tokenizer knows (the padded rows of the output
    layer are never chosen); ``first_index``: the index of ``prompts[0]`` among
    all prompts (seeds its random generator).
    """
    from megatron.core.inference.contexts import StaticInferenceContext

    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    total = int(lengths.max()) + options.max_new_tokens
    device = next(model.parameters()).device
    tokens = torch.full((b, total), eod, dtype=torch.long)  # [b, s]: prompts, right-padded
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    tokens = tokens.to(device)
    positions = torch.arange(total, device=device)[None].expand(b, total)  # [b, s]
    generators = [prompt_generator(options.seed, first_index + i) for i in range(b)]
    ctx = StaticInferenceContext(max_batch_size=b, max_sequence_length=total)
    new: list[list[int]] = [[] for _ in range(b)]
    stop: list[Optional[str]] = [None] * b
    start, end = 0, int(lengths.min())
    while True:
        logits = model(tokens[:, start:end], positions[:, start:end], None,
                       inference_context=ctx, runtime_gather_output=True)  # [b, 1, V_padded]
        ctx.sequence_len_offset += end - start
        # the rows past their prompt and not done; only they draw (a row's random
        # stream then depends on its own tokens alone, not on the batch)
        rows = [i for i in range(b) if stop[i] is None and lengths[i] <= end]
        chosen: list[int] = []
        if rows:  # none while the rows left are all still inside their prompts
            last = logits[rows, -1, :vocab_size].float().cpu()  # [rows, V]
            picked = choose_tokens(last, options, [generators[i] for i in rows])
            chosen = _same_on_tp_ranks(picked.to(device)).tolist()  # NCCL: device tensors
        for i, token in zip(rows, chosen):
            tokens[i, end] = token
            if options.stop_at_eod and token == eod:
                stop[i] = "eod"
                continue
            new[i].append(token)
            if len(new[i]) == options.max_new_tokens:
                stop[i] = "length"
        if all(s is not None for s in stop):
            return [(n, s) for n, s in zip(new, stop)]
        if bool((lengths <= end + 1).all()):
            ctx.enable_decode_mode()  # every row is past its prompt, as megatron marks it
        start, end = end, end + 1


def _check_fits(prompts: Sequence[Sequence[int]], options: SamplingOptions, cfg: RunConfig) -> None:
    limit = cfg.model.max_position_embeddings
    for n, p in enumerate(prompts, 1):
        if not p:
            raise ConfigError(f"prompt {n} is empty")
        if len(p) + options.max_new_tokens > limit:
            raise ConfigError(
                f"prompt {n} has {len(p)} tokens: with --max-new-tokens {options.max_new_tokens} "
                f"that is {len(p) + options.max_new_tokens} positions, more than the model's "
                f"max_position_embeddings {limit}")


def _check_one_document(prompts: Sequence[Sequence[int]], eod: int, cfg: RunConfig,
                        options: SamplingOptions) -> None:
    """A run that separated documents (``data.reset_attention_mask``) never attended
    or shifted across an EOD, and the decode keeps no document boundaries inside a
    row: a prompt (its tokens, the EOD prefix aside) holding one is refused, and so
    is generating past one (``--no-stop-at-eod``)."""
    if not cfg.data.reset_attention_mask:
        return
    never = ("generation would attend to and shift with the document before it, which the "
             "model never did")
    if not options.stop_at_eod:
        raise ConfigError(f"--no-stop-at-eod: the run kept documents apart "
                          f"(data.reset_attention_mask): past an end-of-document token {never}")
    for n, p in enumerate(prompts, 1):
        if eod in p:
            raise ConfigError(
                f"prompt {n}: token {list(p).index(eod) + 1} is the end-of-document id {eod}, "
                f"and the run kept documents apart (data.reset_attention_mask): {never}; "
                "give one document per prompt")


def generate(model: torch.nn.Module, cfg: RunConfig, codec: PromptCodec,
             prompts: Sequence[tuple[str, dict]], options: SamplingOptions,
             batch_size: int = 8, prefix_eod: Optional[bool] = None) -> list[Generation]:
    """Generates for every prompt, ``batch_size`` prompts per static batch.

    ``prefix_eod``: feed the end-of-document token before each prompt, so that
    the prompt starts a document as in training (preprocessing ends every
    document with EOD; the model never saw a BOS token). None: feed it unless the
    run separated documents (``data.reset_attention_mask``): there a document's
    first token attended to, and shifted with, nothing before it, never an EOD; and
    such a run's prompts hold no EOD, nor does it generate past one
    (``_check_one_document``).
    """
    if prefix_eod is None:
        prefix_eod = not cfg.data.reset_attention_mask
    options.check()
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1 (got {batch_size})")
    texts = [codec.encode(text, f"prompt {n}") for n, (text, _) in enumerate(prompts, 1)]
    _check_one_document(texts, codec.eod, cfg, options)
    ids = [([codec.eod] if prefix_eod else []) + t for t in texts]
    _check_fits(ids, options, cfg)
    out = []
    for first in range(0, len(ids), batch_size):
        batch = ids[first:first + batch_size]
        results = generate_ids(model, batch, options, codec.eod, codec.vocab_size, first)
        for (text, extra), p, (new, stop) in zip(prompts[first:], batch, results):
            out.append(Generation(text, list(p), new, codec.decode(new), stop, dict(extra)))
    return out


__all__ = ["Generation", "PromptCodec", "SamplingOptions", "choose_tokens", "generate",
           "generate_ids", "prompt_generator", "read_prompts"]
