"""``kvtrain eval`` on a Hugging Face folder: lm-evaluation-harness on two local
tasks (multiple choice, loglikelihood), offline end to end; its log-likelihoods
equal the model's own forward; refused tasks in one line.

The model is a tiny random ``LlamaForCausalLM`` with a BPE tokenizer trained
here (no download); the tasks are YAMLs in an include folder reading JSONL
files written here. Everything runs in this process (lm-eval's import and task
index are paid once); sockets are watched so that any network attempt fails
the test.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest
import torch

from kvtrain.cli import main

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
MC_YAML = """task: kvt_mc
dataset_path: json
dataset_kwargs:
  cache_dir: {cache}
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
LL_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  cache_dir: {cache}
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
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


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    """The HF folder and the include folder of four tasks (one has no data file,
    one names a hub dataset that is not in the local cache)."""
    root = tmp_path_factory.mktemp("eval")
    tasks = root / "tasks"
    tasks.mkdir()
    cache = root / "datasets_cache"  # the json loader's arrow files stay in tmp
    (tasks / "mc.yaml").write_text(MC_YAML.format(data=write_jsonl(root / "mc.jsonl", MC), cache=cache))
    (tasks / "ll.yaml").write_text(
        LL_YAML.format(name="kvt_ll", data=write_jsonl(root / "ll.jsonl", LL), cache=cache))
    (tasks / "gone.yaml").write_text(
        LL_YAML.format(name="kvt_gone", data=root / "gone.jsonl", cache=cache))
    (tasks / "hub.yaml").write_text(HUB_YAML)
    return {"root": root, "hf": tiny_hf_llama(root / "hf"), "tasks": tasks}


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


def kvtrain_eval(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def evaluated(local, tmp_path_factory):
    """One ``kvtrain eval`` of the HF folder on both tasks, with the network watched."""
    mp = pytest.MonkeyPatch()
    watch = NetworkWatch(mp)
    out = tmp_path_factory.mktemp("eval_out") / "results.json"
    try:
        code = main(["eval", str(local["hf"]), "--tasks", "kvt_mc,kvt_ll", "--include-path",
                     str(local["tasks"]), "--batch-size", "2", "--device", "cpu",
                     "--log-samples", "--out", str(out)])
    finally:
        mp.undo()
    return {"code": code, "out": out, "attempts": watch.attempts}


def test_eval_runs_offline_end_to_end(evaluated):
    assert evaluated["code"] == 0
    assert evaluated["attempts"] == []
    record = json.loads(evaluated["out"].read_text())
    assert set(record["tasks"]) == {"kvt_mc", "kvt_ll"}
    assert record["n_samples"] == {"kvt_mc": len(MC), "kvt_ll": len(LL)}
    assert {"acc", "acc_stderr"} <= set(record["tasks"]["kvt_mc"])
    assert {"perplexity", "acc"} <= set(record["tasks"]["kvt_ll"])
    assert record["config"]["include_path"] and record["lm_eval_version"]
    samples = evaluated["out"].with_name("results.samples.jsonl")
    assert samples.exists()


def continuation_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of log-softmax of the continuation's tokens after the context, the
    way lm-eval splits a pair (trailing spaces move to the continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    n_context = len(tokenizer.encode(context))
    tokens = torch.tensor([whole])
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits.float()  # [1, s-1, V]
    logp = torch.log_softmax(logits, dim=-1)[0]
    targets = tokens[0, n_context:]
    return float(logp[n_context - 1:].gather(1, targets[:, None]).sum())


def test_loglikelihoods_match_the_models_forward(evaluated, local):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(local["hf"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(local["hf"])
    samples = [json.loads(line) for line in
               evaluated["out"].with_name("results.samples.jsonl").read_text().splitlines()]
    record = json.loads(evaluated["out"].read_text())
    by_task: dict[str, list] = {"kvt_mc": [], "kvt_ll": []}
    for sample in samples:
        ours = [continuation_logprob(model, tokenizer, ctx, cont) for ctx, cont in
                sample["arguments"]]
        theirs = [resp[0][0] for resp in sample["resps"]]
        assert ours == pytest.approx(theirs, abs=1e-4), sample["arguments"]
        by_task[sample["task"]].append((sample, ours))
    assert len(by_task["kvt_mc"]) == len(MC) and len(by_task["kvt_ll"]) == len(LL)
    # the reported metrics follow from those log-likelihoods
    acc = sum(max(range(len(lls)), key=lls.__getitem__) == s["target"]
              for s, lls in by_task["kvt_mc"]) / len(MC)
    assert record["tasks"]["kvt_mc"]["acc"] == pytest.approx(acc)
    mean_ll = sum(lls[0] for _, lls in by_task["kvt_ll"]) / len(LL)
    assert record["tasks"]["kvt_ll"]["perplexity"] == pytest.approx(math.exp(-mean_ll), rel=1e-4)


def test_missing_dataset_is_one_line(local, capsys, monkeypatch):
    watch = NetworkWatch(monkeypatch)
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc,kvt_gone",
                                   "--include-path", str(local["tasks"])], capsys)
    assert code == 2 and watch.attempts == []
    assert len(err.strip().splitlines()) == 1, err
    assert "task 'kvt_gone'" in err and "gone.jsonl" in err and "Traceback" not in err


def test_dataset_not_in_the_local_cache_is_one_line(local, capsys, monkeypatch):
    """A task whose hub dataset is not cached: named, no download tried."""
    watch = NetworkWatch(monkeypatch)
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_hub", "--include-path",
                                   str(local["tasks"])], capsys)
    assert code == 2 and watch.attempts == []
    assert len(err.strip().splitlines()) == 1, err
    assert ("task 'kvt_hub': dataset kvtrain-tests/never-cached is not available offline: "
            "not in the local datasets cache") in err


def test_unknown_task_is_one_line(local, capsys):
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc,no_such_task",
                                   "--include-path", str(local["tasks"])], capsys)
    assert code == 2
    assert err.strip() == ("kvtrain: config error: unknown task 'no_such_task': not one of "
                           f"lm-eval's tasks nor in --include-path {local['tasks']}")


def test_without_the_hf_extra_names_it(local, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    code, out, err = kvtrain_eval([str(local["hf"]), "--tasks", "kvt_mc"], capsys)
    assert code == 2 and "pip install 'kvtrain[hf]'" in err and len(err.strip().splitlines()) == 1
