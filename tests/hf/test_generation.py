"""Generation parity of the KV-shift remote code: a left-padded batch of prompts
of different lengths decodes (greedy, with the cache) every prompt as it decodes
alone and as kvtrain's own forward does; beam search with the cache (the shift
state reordered with the beams) gives the beams of a search that recomputes
the full sequence every step."""

from __future__ import annotations

import pytest
import torch

from kvtrain.hf.export import export_model

from .helpers import VOCAB, build, kvtrain_logits, load_hf, model_config, run_config

EOS = VOCAB - 1  # helpers.run_config: data.eod_id, the export's EOS and PAD
NEW = 7


@pytest.fixture(scope="module")
def models(single_rank, tmp_path_factory):
    """(kvtrain model, HF model) of a GQA model shifting Q, K and V over 2 tokens."""
    from kvtrain.backend import init_model_parallel
    from kvtrain.config import KVShiftConfig

    init_model_parallel(1, 1)
    cfg = run_config(model_config(kv_shift=KVShiftConfig(shift=["q", "k", "v"], window=2)),
                     seed=11)
    model = build(cfg)
    out = tmp_path_factory.mktemp("hf")
    export_model(model, cfg, out)
    return model, load_hf(out)


def prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen) for n in (2, 6, 11)]


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), EOS)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def until_eos(tokens: torch.Tensor) -> list[int]:
    out = []
    for t in tokens.tolist():
        out.append(t)
        if t == EOS:
            break
    return out


def kvtrain_greedy(model, prompt: torch.Tensor) -> list[int]:
    """Greedy decoding by kvtrain's full forward, recomputed every step."""
    seq = prompt[None]
    for _ in range(NEW):
        nxt = kvtrain_logits(model, seq)[:, -1].argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
    return until_eos(seq[0, len(prompt):])


def test_left_padded_batch_greedy_equals_each_prompt_alone(models):
    """... and equals ``kvtrain generate`` (megatron's static batching, one batch)."""
    from kvtrain.inference.generate import SamplingOptions, generate_ids

    kv, hf = models
    rows = prompts()
    ids, mask = left_padded(rows)
    with torch.no_grad():
        batch = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                            do_sample=False, pad_token_id=EOS)
        ours = generate_ids(kv, [r.tolist() for r in rows], SamplingOptions(max_new_tokens=NEW),
                            eod=EOS, vocab_size=VOCAB)
    for i, prompt in enumerate(rows):
        with torch.no_grad():
            alone = hf.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt),
                                dtype=torch.long), max_new_tokens=NEW, do_sample=False,
                                pad_token_id=EOS)
        expected = until_eos(alone[0, len(prompt):])
        assert until_eos(batch[i, ids.shape[1]:]) == expected
        assert kvtrain_greedy(kv, prompt) == expected
        assert ours[i][0] == expected


def test_beam_search_keeps_the_shift_state_with_its_beams(models):
    _, hf = models
    ids, mask = left_padded(prompts()[1:])
    runs = {}
    for use_cache in (True, False):
        with torch.no_grad():
            runs[use_cache] = hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_beams=4,
                num_return_sequences=4, do_sample=False, pad_token_id=EOS, use_cache=use_cache,
                return_dict_in_generate=True, output_scores=True)
    cached, full = runs[True], runs[False]
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(cached.sequences_scores, full.sequences_scores, atol=1e-4, rtol=1e-4)
    # the beams were reordered (otherwise a missing reorder would pass unseen)
    assert any(len(set(b.tolist())) > 1 for b in cached.beam_indices[:, :NEW].T)
