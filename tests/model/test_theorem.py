"""The paper's Theorem 3.3: one KV-shift layer implements an induction head.

With α = (0, 1) (K̂_t = K_{t-1}), β = (1, 0) (V̂_t = V_t), identity Q/K/V/O
projections and near-orthogonal token embeddings, the query at the second
occurrence of token A matches the key of the position right after A's first
occurrence, whose value is the token B that followed A: the layer predicts B.
"""

from __future__ import annotations

import torch

from kvtrain.config import ModelConfig
from kvtrain.model.builder import build_gpt, transformer_config

D, VOCAB, LENGTH = 64, 256, 24


def one_layer_model(alpha):
    cfg = ModelConfig(
        num_layers=1, hidden_size=D, num_attention_heads=1, vocab_size=VOCAB,
        max_position_embeddings=64, position_embedding="none", attention="kv_shift",
        make_vocab_size_divisible_by=1,
    )
    model = build_gpt(cfg, transformer_config(cfg), seed=0)
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(VOCAB, D, generator=gen) / D**0.5  # near-orthogonal, norm ≈ 1
    eye = torch.eye(D)
    layer = model.decoder.layers[0]
    attn = layer.self_attention
    with torch.no_grad():
        model.embedding.word_embeddings.weight.copy_(emb)
        model.output_layer.weight.copy_(emb)  # logits = <h, e_token>
        # Q = 4·X (a sharper softmax), K = X, V = X; O = I.
        attn.linear_qkv.weight.copy_(torch.cat([4 * eye, eye, eye]))
        attn.linear_proj.weight.copy_(eye)
        attn.shift_k.copy_(torch.tensor([alpha]))
        attn.shift_v.copy_(torch.tensor([[1.0, 0.0]]))
        layer.mlp.linear_fc2.weight.zero_()  # attention only
    return model.eval()


def induction_batch(n: int):
    """Distinct tokens x_1..x_T, then x_{T+1} = x_i for a random i < T."""
    gen = torch.Generator().manual_seed(1)
    seqs, targets = [], []
    for _ in range(n):
        toks = torch.randperm(VOCAB, generator=gen)[:LENGTH - 1]
        i = int(torch.randint(0, LENGTH - 2, (1,), generator=gen))
        seqs.append(torch.cat([toks, toks[i:i + 1]]))
        targets.append(int(toks[i + 1]))
    return torch.stack(seqs), torch.tensor(targets)


def predictions(model, tokens):
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    with torch.no_grad():
        out = model(tokens, pos, None)  # [b, s, vocab]
    return out[:, -1, :VOCAB].argmax(-1)


def test_one_kv_shift_layer_is_an_induction_head(mp1):
    tokens, targets = induction_batch(64)
    pred = predictions(one_layer_model(alpha=[0.0, 1.0]), tokens)
    assert (pred == targets).float().mean().item() == 1.0


def test_without_the_shift_the_same_layer_copies_instead(mp1):
    """α = (1, 0) (vanilla keys): the query matches A itself and the layer predicts A again."""
    tokens, targets = induction_batch(64)
    pred = predictions(one_layer_model(alpha=[1.0, 0.0]), tokens)
    assert (pred == targets).float().mean().item() < 0.1
    assert (pred == tokens[:, -1]).float().mean().item() > 0.9
