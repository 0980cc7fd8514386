"""Shared pieces of the ``kvtrain eval`` tests: two local lm-eval tasks
(multiple choice, loglikelihood) as YAMLs + JSONL, a tiny HF Llama, and a
continuation's log-likelihood split the way lm-eval splits it."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Callable

import pytest
import torch

WORDS = ("the cat sat on the mat . a dog ran in the park . the sun is hot and the sky is blue . "
         "birds fly over the sea and fish swim under it .")
MC = [{"question": "the cat sat on the", "choices": ["mat", "sky", "dog"], "answer": 0},
      {"question": "the sky is", "choices": ["hot", "blue", "park"], "answer": 1},
      {"question": "a dog ran in the", "choices": ["park", "mat"], "answer": 0},
      {"question": "birds fly over the", "choices": ["sea", "cat", "sun"], "answer": 0}]
# "the cat sat on" + " the mat" is the first MC request's tokens with the split one token
# earlier: lm-eval's logits cache scored such pairs wrongly (kvtrain turns it off)
LL = [{"context": "the cat sat on", "target": "the mat"},
      {"context": "the sun is", "target": "hot and the sky is blue"},
      {"context": "fish swim", "target": "under it"}]
# a task over a local JSONL file (the datasets cache in tmp)
LOCAL_DATA = """dataset_path: json
dataset_kwargs:
  cache_dir: {cache}
  data_files:
    test: {data}
test_split: test
"""
MC_YAML = """task: kvt_mc
""" + LOCAL_DATA + """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
LL_YAML = """task: {name}
""" + LOCAL_DATA + """output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

HUB_YAML = """task: kvt_hub
dataset_path: kvtrain-tests/never-cached
test_split: test
output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
"""

# a document scored whole (perplexity tasks such as wikitext): lm-eval puts a prefix
# token before its first token
ROLL_DOC = "the cat sat on the mat . a dog ran in the park ."
ROLL_YAML = """task: kvt_roll
""" + LOCAL_DATA + """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""

GROUP_YAML = """group: kvt_grp
task:
  - kvt_mc
  - kvt_ll
aggregate_metric_list:
  - metric: acc
    weight_by_size: true
"""


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_hf_llama(folder: Path) -> Path:
    """A random 2-layer Llama (GQA) with a BPE tokenizer trained on WORDS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([WORDS] * 4, trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_tasks(root: Path) -> Path:
    """``root/tasks``: kvt_mc, kvt_ll (data in ``root``), kvt_gone (its data file
    is missing), kvt_bad (its data file has a broken line), kvt_hub (a hub
    dataset not in the local cache), kvt_roll (one document scored whole), kvt_grp (a group of kvt_mc and kvt_ll, its
    accuracy averaged over their examples)."""
    tasks = root / "tasks"
    tasks.mkdir(parents=True)
    cache = root / "datasets_cache"  # the json loader's arrow files stay in tmp
    (tasks / "mc.yaml").write_text(MC_YAML.format(data=write_jsonl(root / "mc.jsonl", MC),
                                                  cache=cache))
    (tasks / "ll.yaml").write_text(
        LL_YAML.format(name="kvt_ll", data=write_jsonl(root / "ll.jsonl", LL), cache=cache))
    (tasks / "gone.yaml").write_text(
        LL_YAML.format(name="kvt_gone", data=root / "gone.jsonl", cache=cache))
    bad = root / "bad.jsonl"  # a line cut short, as by a copy that failed
    bad.write_text(json.dumps(LL[0]) + "\n" + json.dumps(LL[1])[:20] + "\n")
    (tasks / "bad.yaml").write_text(LL_YAML.format(name="kvt_bad", data=bad, cache=cache))
    (tasks / "hub.yaml").write_text(HUB_YAML)
    (tasks / "roll.yaml").write_text(ROLL_YAML.format(
        data=write_jsonl(root / "roll.jsonl", [{"text": ROLL_DOC}]), cache=cache))
    (tasks / "group.yaml").write_text(GROUP_YAML)
    return tasks


def split_pair(encode: Callable[[str], list[int]], context: str,
               continuation: str) -> tuple[list[int], int]:
    """(context + continuation tokens, context length) as lm-eval splits a causal
    request: trailing spaces move to the continuation, the whole is encoded once."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    return encode(context + continuation), len(encode(context))


def continuation_logprob(logits_of: Callable[[torch.Tensor], torch.Tensor],
                         encode: Callable[[str], list[int]], context: str,
                         continuation: str) -> float:
    """Sum of the log-softmax of the continuation's tokens; ``logits_of`` maps
    ``[1, s]`` tokens to ``[1, s, V]`` logits."""
    whole, n_context = split_pair(encode, context, continuation)
    tokens = torch.tensor([whole])
    with torch.no_grad():
        logp = torch.log_softmax(logits_of(tokens[:, :-1]).double(), dim=-1)[0]  # [s-1, V]
    targets = tokens[0, n_context:]
    return float(logp[n_context - 1:].gather(1, targets[:, None]).sum())


def read_samples(record: Path) -> list[dict]:
    """The ``--log-samples`` file next to a results record."""
    side = record.with_name(record.stem + ".samples.jsonl")
    return [json.loads(line) for line in side.read_text().splitlines()]


def check_samples(samples: list[dict], record: dict, logits_of, encode) -> None:
    """Every request's log-likelihood equals ``logits_of``'s (1e-4), and the
    record's metrics follow from them (MC accuracy, loglikelihood perplexity)."""
    by_task: dict[str, list] = {"kvt_mc": [], "kvt_ll": []}
    for sample in samples:
        ours = [continuation_logprob(logits_of, encode, ctx, cont)
                for ctx, cont in sample["arguments"]]
        theirs = [resp[0][0] for resp in sample["resps"]]
        assert ours == pytest.approx(theirs, abs=1e-4), sample["arguments"]
        by_task[sample["task"]].append((sample, ours))
    assert len(by_task["kvt_mc"]) == len(MC) and len(by_task["kvt_ll"]) == len(LL)
    acc = sum(max(range(len(lls)), key=lls.__getitem__) == s["target"]
              for s, lls in by_task["kvt_mc"]) / len(MC)
    assert record["tasks"]["kvt_mc"]["acc"] == pytest.approx(acc)
    mean_ll = sum(lls[0] for _, lls in by_task["kvt_ll"]) / len(LL)
    assert record["tasks"]["kvt_ll"]["perplexity"] == pytest.approx(math.exp(-mean_ll), rel=1e-4)


class NetworkWatch:
    """Records (and refuses) every IP connection attempted while it is installed."""

    def __init__(self, monkeypatch):
        self.attempts: list = []
        real_connect = socket.socket.connect

        def connect(sock, address):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                self.attempts.append(address)
                raise OSError(f"test: network attempt to {address}")
            return real_connect(sock, address)

        monkeypatch.setattr(socket.socket, "connect", connect)
