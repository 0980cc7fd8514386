"""``kvtrain generate``: megatron static-batching generation from a trained run.

Generation parity: on a batch of prompts of different lengths, every prompt
gets the tokens it gets alone, and the tokens a reference gets that recomputes
the whole sequence each step without any cache (so the KV-shift decode state
and the KV cache are exercised against the plain forward); TP=2 gives what
TP=1 gives. The runs are the session's tiny vanilla / KV-shift arms
(``arm_runs`` in tests/conftest.py), trained by the real trainer on mock data
(counting sequences, so greedy continuations are far from ties).
"""

from __future__ import annotations

import json

import pytest
import torch

from kvtrain.cli import main
from kvtrain.testing import run_distributed

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], [100, 101, 102, 103], [7]]  # different lengths


def load(run_dir):
    from kvtrain.inference.generate import PromptCodec
    from kvtrain.inference.loading import load_model

    loaded = load_model(run_dir)
    return loaded, PromptCodec.for_run(loaded.config)


def recompute_greedy(model, prompt, n, vocab):
    """The reference: the whole sequence through the model, no cache, each step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tok = torch.tensor([seq])
            logits = model(tok, torch.arange(len(seq))[None], None, runtime_gather_output=True)
            seq.append(int(logits[0, -1, :vocab].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("arm", ["kv_shift", "vanilla"])
def test_batch_equals_alone_equals_recompute(mp1, arm_runs, arm):
    from kvtrain.inference.generate import SamplingOptions, generate_ids

    loaded, codec = load(arm_runs[arm])
    opts = SamplingOptions(max_new_tokens=6, stop_at_eod=False)
    batch = generate_ids(loaded.model, PROMPTS, opts, codec.eod, codec.vocab_size)
    for prompt, (tokens, stop) in zip(PROMPTS, batch):
        alone = generate_ids(loaded.model, [prompt], opts, codec.eod, codec.vocab_size)
        assert alone == [(tokens, stop)] and stop == "length"
        assert tokens == recompute_greedy(loaded.model, prompt, 6, codec.vocab_size)
    # the trained model continues the counting sequences at least at first
    assert batch[0][0][0] == 12 and batch[2][0][0] == 104


def test_sampling_is_seeded_and_batch_invariant(mp1, arm_runs):
    from kvtrain.inference.generate import SamplingOptions, generate_ids

    loaded, codec = load(arm_runs["kv_shift"])
    args = (codec.eod, codec.vocab_size)
    hot = SamplingOptions(max_new_tokens=8, temperature=5.0, top_p=0.95, seed=3,
                          stop_at_eod=False)
    batch = generate_ids(loaded.model, PROMPTS, hot, *args)
    assert batch == generate_ids(loaded.model, PROMPTS, hot, *args)  # seeded
    for i, prompt in enumerate(PROMPTS):  # prompt i's generator: (seed, i), in any batch
        assert generate_ids(loaded.model, [prompt], hot, *args, first_index=i) == [batch[i]]
    other = generate_ids(loaded.model, PROMPTS, SamplingOptions(
        max_new_tokens=8, temperature=5.0, top_p=0.95, seed=4, stop_at_eod=False), *args)
    assert other != batch
    greedy = generate_ids(loaded.model, PROMPTS, SamplingOptions(max_new_tokens=8,
                                                                 stop_at_eod=False), *args)
    assert greedy != batch  # a hot temperature leaves the argmax path
    for cut in (dict(top_k=1), dict(top_p=1e-6)):  # a nucleus of one token is greedy
        narrow = SamplingOptions(max_new_tokens=8, temperature=5.0, stop_at_eod=False, **cut)
        assert generate_ids(loaded.model, PROMPTS, narrow, *args) == greedy


def test_stops_at_eod(mp1, arm_runs):
    from kvtrain.inference.generate import SamplingOptions, generate_ids

    loaded, codec = load(arm_runs["kv_shift"])
    opts = SamplingOptions(max_new_tokens=5, stop_at_eod=False)
    (free,) = generate_ids(loaded.model, [PROMPTS[0]], opts, codec.eod, codec.vocab_size)
    # make the third generated token the end of document: generation stops before it
    eod = free[0][2]
    (stopped,) = generate_ids(loaded.model, [PROMPTS[0]], SamplingOptions(max_new_tokens=5),
                              eod, codec.vocab_size)
    assert stopped == (free[0][:2], "eod")


def _tp_generate(rank, world, run_dir, prompts):
    from kvtrain.backend import init_model_parallel, set_seed
    from kvtrain.inference.generate import SamplingOptions, generate_ids

    init_model_parallel(tensor=world)
    set_seed(1)
    loaded, codec = load(run_dir)
    out = []
    for opts in (SamplingOptions(max_new_tokens=6, stop_at_eod=False),
                 SamplingOptions(max_new_tokens=6, temperature=2.0, top_p=0.9, stop_at_eod=False)):
        out.append(generate_ids(loaded.model, prompts, opts, codec.eod, codec.vocab_size))
    return out


@pytest.mark.slow
def test_tp2_equals_tp1(mp1, arm_runs):
    from kvtrain.inference.generate import SamplingOptions, generate_ids

    ranks = run_distributed(_tp_generate, 2, str(arm_runs["kv_shift"]), PROMPTS)
    assert ranks[0] == ranks[1]  # every TP rank ends with the same tokens
    loaded, codec = load(arm_runs["kv_shift"])
    greedy = generate_ids(loaded.model, PROMPTS, SamplingOptions(max_new_tokens=6,
                                                                 stop_at_eod=False),
                          codec.eod, codec.vocab_size)
    sampled = generate_ids(loaded.model, PROMPTS, SamplingOptions(
        max_new_tokens=6, temperature=2.0, top_p=0.9, stop_at_eod=False),
        codec.eod, codec.vocab_size)
    assert ranks[0] == [greedy, sampled]


def test_cli_prompts_file_and_out(mp1, arm_runs, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "5 6 7 8 9 10 11"}) + "\n\n"
                       + json.dumps("40 41") + "\n")
    out = tmp_path / "gen.jsonl"
    code = main(["generate", str(arm_runs["kv_shift"]), "--prompts", str(prompts),
                 "--prompt", "100 101 102 103", "--max-new-tokens", "4", "--no-stop-at-eod",
                 "--batch-size", "2", "--out", str(out)])
    assert code == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["100 101 102 103", "5 6 7 8 9 10 11", "40 41"]
    assert records[1]["id"] == "a" and records[1]["prompt_tokens"][0] == 383  # the EOD prefix
    assert all(len(r["tokens"]) == 4 and r["stop"] == "length" for r in records)
    assert records[0]["text"] == " ".join(map(str, records[0]["tokens"]))
    assert records[0]["iteration"] == 8 and records[0]["checkpoint"].endswith("iter_0000008")
    # what made them: the resolved backend (auto: torch on a CPU), dtype and TP ranks
    assert {(r["backend"], r["dtype"], r["tensor_parallel"]) for r in records} == {
        ("torch", "fp32", 1)}
    printed = capsys.readouterr().out
    assert "backend torch, fp32" in printed
    assert f"--- [2] 5 6 7 8 9 10 11\n{records[1]['text']}\n" in printed


@pytest.mark.parametrize("argv,message", [
    ([], "no prompt: give --prompt TEXT or --prompts FILE"),
    (["--prompt", "hello"], "the run has no tokenizer (data.tokenizer: null)"),
    (["--prompt", "1 999"], "token id 999 is outside the vocabulary [0, 384)"),
    (["--prompt", "1 2", "--max-new-tokens", "70"],
     "prompt 1 has 3 tokens: with --max-new-tokens 70 that is 73 positions, more than"),
    (["--prompt", "1", "--top-p", "0.5"], "--top-p/--top-k need sampling"),
    (["--prompt", "1", "--prompts", "/nonexistent/p.txt"], "--prompts /nonexistent/p.txt"),
    (["--prompt", "1", "--tokenizer", "/nonexistent/tok.model"],
     "--tokenizer /nonexistent/tok.model: cannot load"),
    # no EOD before it: nothing to generate from
    (["--prompt", "1", "--prompt", "", "--no-eod-prefix"], "prompt 2 is empty"),
])
def test_bad_input_is_one_line(mp1, arm_runs, capsys, argv, message):
    assert main(["generate", str(arm_runs["kv_shift"]), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtrain: config error: ") and message in err and "\n" not in err


def test_an_out_path_that_cannot_be_written_is_refused_before_generating(tmp_path, capsys):
    """--out is checked before the model is loaded (it was a traceback after
    every prompt had been generated)."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    for out, message in ((tmp_path, f"--out {tmp_path} is a folder, not a file"),
                         (blocker / "g.jsonl",
                          f"--out {blocker}/g.jsonl: {blocker} is a file, not a folder"),
                         # a folder nothing can be written in (and one that cannot be
                         # made): the generations were printed, then a traceback
                         ("/proc/kvtrain-g.jsonl", "--out /proc/kvtrain-g.jsonl cannot be "
                                                   "written in /proc: No such file or directory"),
                         ("/proc/new/g.jsonl", "--out /proc/new/g.jsonl cannot be written in "
                                               "/proc/new: No such file or directory")):
        # the source is not a run: the --out check comes first, before any loading
        assert main(["generate", str(tmp_path / "run"), "--prompt", "1", "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"kvtrain: config error: {message}"


def test_out_in_a_new_folder(mp1, arm_runs, tmp_path):
    out = tmp_path / "new" / "sub" / "g.jsonl"
    assert main(["generate", str(arm_runs["kv_shift"]), "--prompt", "1 2", "--max-new-tokens",
                 "2", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 1


def test_not_a_run_is_one_line(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvtrain: config error: {tmp_path} holds no complete kvtrain checkpoint"


def test_text_prompts_through_the_tokenizer(mp1, arm_runs, tmp_path):
    """With a sentencepiece model (here one trained on the spot, smaller than the
    model's vocabulary) prompts are text, the EOD prefix is its EOS and the
    output is decoded text."""
    import sentencepiece as spm

    from kvtrain.inference.generate import PromptCodec, SamplingOptions, generate

    lines = [f"the {w} sat on the mat number {i}" for i in range(60) for w in ("cat", "dog")]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "t"),
                                   vocab_size=64, model_type="bpe", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=3, minloglevel=2)
    loaded, _ = load(arm_runs["kv_shift"])
    codec = PromptCodec.for_run(loaded.config, str(tmp_path / "t.model"))
    assert codec.eod == 2 and codec.vocab_size == 64
    opts = SamplingOptions(max_new_tokens=5, stop_at_eod=False)
    (g,) = generate(loaded.model, loaded.config, codec, [("the cat sat", {})], opts)
    assert g.prompt_tokens == [2] + codec.tokenizer.encode("the cat sat")
    assert len(g.tokens) == 5 and all(0 <= t < 64 for t in g.tokens)
    assert g.text == codec.tokenizer.decode(g.tokens)


def test_a_run_whose_tokenizer_is_gone_asks_for_another(tmp_path):
    """The run's data.tokenizer cannot be loaded (moved, deleted): one line that says
    so and how to go on (``--tokenizer``); a ``--tokenizer`` that cannot be loaded is
    named as itself."""
    from kvtrain.config import ConfigError, RunConfig
    from kvtrain.inference.generate import PromptCodec

    cfg = RunConfig()
    cfg.data.tokenizer = str(tmp_path / "gone.model")
    with pytest.raises(ConfigError) as e:
        PromptCodec.for_run(cfg)
    assert str(e.value).startswith(f"the run's data.tokenizer {tmp_path / 'gone.model'}: "
                                   "cannot load (")
    assert str(e.value).endswith("; name another with --tokenizer") and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=f"^--tokenizer {tmp_path / 'other.model'}: cannot load"):
        PromptCodec.for_run(cfg, str(tmp_path / "other.model"))


def test_tensor_parallel_size_must_split_the_heads():
    from kvtrain.commands.generate import check_tensor_parallel
    from kvtrain.config import ConfigError, RunConfig
    from kvtrain.config.model import ModelConfig

    cfg = RunConfig(model=ModelConfig(num_attention_heads=4, num_query_groups=2))
    check_tensor_parallel(cfg, 2)
    with pytest.raises(ConfigError, match="4 heads / 2 KV heads do not divide by 4 ranks"):
        check_tensor_parallel(cfg, 4)


def test_rows_waiting_in_their_prompt_while_the_others_are_done(mp1, arm_runs):
    """A short prompt done before a long one leaves its prompt: steps with no row
    to draw for (sampling used to fail on them)."""
    from kvtrain.inference.generate import SamplingOptions, generate_ids

    loaded, codec = load(arm_runs["kv_shift"])
    prompts = [[5], list(range(20, 30))]
    for opts in (SamplingOptions(max_new_tokens=1, stop_at_eod=False),
                 SamplingOptions(max_new_tokens=1, temperature=1.0, stop_at_eod=False)):
        batch = generate_ids(loaded.model, prompts, opts, codec.eod, codec.vocab_size)
        assert [len(t) for t, _ in batch] == [1, 1]
        alone = generate_ids(loaded.model, prompts[1:], opts, codec.eod, codec.vocab_size,
                             first_index=1)
        assert batch[1] == alone[0]


def test_an_empty_prompts_file_is_named(tmp_path):
    """An empty --prompts file is its own line (was "no prompt: give --prompt ...")."""
    import re

    from kvtrain.config import ConfigError
    from kvtrain.inference.generate import read_prompts

    for name, text in (("p.txt", ""), ("p.jsonl", "\n  \n")):
        (tmp_path / name).write_text(text)
        for given in ([], ["a prompt"]):
            with pytest.raises(ConfigError, match=re.escape(f"--prompts {tmp_path / name}: "
                                                            "no prompt in it")):
                read_prompts(given, str(tmp_path / name))


def test_prompt_files_and_sampling_options_that_cannot_be_used_are_one_line(
        mp1, arm_runs, tmp_path, capsys):
    """A ``.jsonl`` prompts file with a line that is not JSON, or not a string or an
    object with a ``prompt`` string, names the file and line; sampling options out of
    range name the option."""
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('"1 2"\n{"prompt": 3\n')
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('[1, 2]\n')
    for argv, message in (
            (["--prompts", str(bad_json)], f"--prompts {bad_json} line 2: not JSON ("),
            (["--prompts", str(wrong)], f"--prompts {wrong} line 1: expected a JSON string or "
                                        'an object with a "prompt" string'),
            (["--prompt", "1", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1 (got 0)"),
            (["--prompt", "1", "--temperature", "-1"],
             "--temperature must be >= 0 and finite (got -1.0)"),
            (["--prompt", "1", "--temperature", "inf"],
             "--temperature must be >= 0 and finite (got inf)"),
            (["--prompt", "1", "--temperature", "1", "--top-p", "1.5"],
             "--top-p must be in (0, 1] (got 1.5)"),
            (["--prompt", "1", "--temperature", "1", "--top-k", "-1"],
             "--top-k must be >= 0 (got -1)"),
            (["--prompt", "1", "--batch-size", "0"], "--batch-size must be >= 1 (got 0)")):
        assert main(["generate", str(arm_runs["kv_shift"]), *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("kvtrain: config error: ") and message in err, (argv, err)
        assert "\n" not in err


def test_a_plain_text_prompts_file_gives_a_prompt_per_line(mp1, arm_runs, tmp_path, capsys):
    """Any other file than ``.jsonl`` holds one prompt per line as it is (blank lines
    skipped)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("1 2 3\n\n4 5\n")
    out = tmp_path / "g.jsonl"
    assert main(["generate", str(arm_runs["kv_shift"]), "--prompts", str(prompts),
                 "--max-new-tokens", "2", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["1 2 3", "4 5"]


def test_the_eod_prefix_follows_how_the_run_saw_documents(mp1, arm_runs):
    """A run that separated documents (data.reset_attention_mask) never saw an EOD
    before a document's first token: its prompts go in without one; other runs'
    with one (a document there follows the previous one's EOD)."""
    import dataclasses

    from kvtrain.inference.generate import SamplingOptions, generate

    loaded, codec = load(arm_runs["kv_shift"])
    separated = dataclasses.replace(
        loaded.config, data=dataclasses.replace(loaded.config.data, reset_attention_mask=True))
    prompts = [(" ".join(map(str, PROMPTS[1])), {})]
    options = SamplingOptions(max_new_tokens=2)
    for cfg, first in ((loaded.config, [codec.eod]), (separated, [])):
        assert not loaded.config.data.reset_attention_mask
        (result,) = generate(loaded.model, cfg, codec, prompts, options)
        assert result.prompt_tokens == first + PROMPTS[1], result.prompt_tokens
    (result,) = generate(loaded.model, separated, codec, prompts, options, prefix_eod=True)
    assert result.prompt_tokens == [codec.eod] + PROMPTS[1]  # asked for: given


def test_a_nan_temperature_is_one_line(tmp_path, capsys):
    """--temperature nan passed the ``< 0`` check and ended in a traceback from
    torch.multinomial after the model was loaded."""
    assert main(["generate", str(tmp_path / "run"), "--prompt", "1",
                 "--temperature", "nan"]) == 2
    assert capsys.readouterr().err.strip() == \
        "kvtrain: config error: --temperature must be >= 0 and finite (got nan)"


def test_a_tiny_temperature_samples_the_argmax():
    """logits / temperature overflowed to inf for a temperature near 0 (1e-40),
    and the softmax of inf - inf is NaN: torch.multinomial raised. A temperature
    fp32 rounds to 0 (1e-320) made 0 / 0 for the max: raised the same."""
    from kvtrain.inference.generate import SamplingOptions, choose_tokens

    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [0.5, -1.0, 4.0, 3.9]])  # [b, V]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    for cut in ({}, dict(top_k=2), dict(top_p=0.5)):
        for temperature in (1e-40, 1e-320):
            options = SamplingOptions(temperature=temperature, **cut).check()
            assert choose_tokens(logits, options, gens).tolist() == [1, 2]


def test_a_seed_torch_cannot_take_is_one_line(tmp_path, capsys):
    """A --seed outside torch's 64-bit range passed the checks and raised
    'Overflow when unpacking long long' when the generators were seeded (greedy too)."""
    from kvtrain.inference.generate import SamplingOptions

    for seed in (2**63, -2**63 - 1):
        assert main(["generate", str(tmp_path / "run"), "--prompt", "1",
                     "--seed", str(seed)]) == 2
        assert capsys.readouterr().err.strip() == \
            f"kvtrain: config error: --seed must be in [-2^63, 2^63) (got {seed})"
    SamplingOptions(seed=-2**63).check()
    SamplingOptions(seed=2**63 - 1).check()


def test_a_prompt_that_is_not_utf8_is_one_line(tmp_path, capsys):
    """A --prompt of bytes that are not UTF-8 (the shell hands them on as lone
    surrogates), or a JSONL prompt with a lone surrogate escape, reached
    sentencepiece after the model was loaded: a pybind11 cast traceback."""
    import os

    lines = tmp_path / "p.jsonl"
    lines.write_text('"1 2"\n{"prompt": "the \\udcff cat"}\n')
    for argv, message in (
            (["--prompt", "1", "--prompt", os.fsdecode(b"the \xff cat")],
             "--prompt 2: not UTF-8 text ('\\udcff' at character 4)"),
            (["--prompts", str(lines)],
             f"--prompts {lines} line 2: not UTF-8 text ('\\udcff' at character 4)")):
        assert main(["generate", str(tmp_path / "run"), *argv]) == 2
        assert capsys.readouterr().err.strip() == f"kvtrain: config error: {message}"


def test_a_prompts_file_with_a_byte_order_mark(tmp_path):
    """A UTF-8 file starting with a byte order mark (Windows editors write one):
    its .jsonl form was refused ("Unexpected UTF-8 BOM"), and in a plain file the
    mark became part of the first prompt (fed to the tokenizer)."""
    from kvtrain.inference.generate import read_prompts

    for name, text in (("p.jsonl", '{"prompt": "5 6"}\n"7"\n'), ("p.txt", "5 6\n7\n")):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert read_prompts([], str(tmp_path / name)) == [("5 6", {}), ("7", {})]


@pytest.mark.parametrize("backend, dtype", [("local", torch.float32), ("torch", torch.bfloat16)])
def test_other_backends_and_bf16_decode_as_the_default(mp1, arm_runs, backend, dtype):
    """``--backend local`` and ``--dtype bf16`` (the KV-shift decode state in bf16):
    a batch gets what each prompt gets alone and what a cache-free recompute gets,
    on the model of that backend and dtype; the counting sequences go on (the
    trained model's greedy answer, far from ties, survives bf16)."""
    from kvtrain.inference.generate import PromptCodec, SamplingOptions, generate_ids
    from kvtrain.inference.loading import load_model

    loaded = load_model(arm_runs["kv_shift"], backend=backend, dtype=dtype)
    assert loaded.backend == backend
    assert next(loaded.model.parameters()).dtype == dtype
    codec = PromptCodec.for_run(loaded.config)
    opts = SamplingOptions(max_new_tokens=4, stop_at_eod=False)
    batch = generate_ids(loaded.model, PROMPTS, opts, codec.eod, codec.vocab_size)
    for prompt, (tokens, _) in zip(PROMPTS, batch):
        assert generate_ids(loaded.model, [prompt], opts, codec.eod, codec.vocab_size)[0][0] \
            == tokens
        assert tokens == recompute_greedy(loaded.model, prompt, 4, codec.vocab_size)
    assert batch[0][0][0] == 12 and batch[2][0][0] == 104


def test_an_end_of_document_inside_a_prompt_of_a_run_that_separated_documents(mp1, arm_runs):
    """A run that kept documents apart (data.reset_attention_mask) never attended or
    shifted across an EOD; the decode does not separate documents, so a prompt with
    an EOD in it was continued from both documents (other tokens than the document
    after it alone gets, without a word), and so was a generation past an EOD
    (--no-stop-at-eod): one line each. A run that packed documents without
    separating them attended across EODs in training: its prompts may hold one."""
    import dataclasses

    from kvtrain.config import ConfigError
    from kvtrain.inference.generate import SamplingOptions, generate

    loaded, codec = load(arm_runs["kv_shift"])
    separated = dataclasses.replace(
        loaded.config, data=dataclasses.replace(loaded.config.data, reset_attention_mask=True))
    prompts = [("5 6 7", {}), (f"40 41 {codec.eod} 42", {})]
    options = SamplingOptions(max_new_tokens=2)
    with pytest.raises(ConfigError) as e:
        generate(loaded.model, separated, codec, prompts, options)
    assert str(e.value) == (
        f"prompt 2: token 3 is the end-of-document id {codec.eod}, and the run kept documents "
        "apart (data.reset_attention_mask): generation would attend to and shift with the "
        "document before it, which the model never did; give one document per prompt")
    with pytest.raises(ConfigError, match=r"^--no-stop-at-eod: the run kept documents apart "
                       r"\(data.reset_attention_mask\): past an end-of-document token generation "
                       "would attend to and shift with the document before it, which the model "
                       "never did$"):
        generate(loaded.model, separated, codec, prompts[:1],
                 SamplingOptions(max_new_tokens=2, stop_at_eod=False))
    # asked for, the EOD before a prompt is no document boundary inside it
    generate(loaded.model, separated, codec, prompts[:1], options, prefix_eod=True)
    generate(loaded.model, loaded.config, codec, prompts, SamplingOptions(
        max_new_tokens=2, stop_at_eod=False))
    (_, packed) = generate(loaded.model, loaded.config, codec, prompts, options)
    assert packed.prompt_tokens == [codec.eod, 40, 41, codec.eod, 42]


def test_a_prompt_holding_a_unicode_line_break_or_form_feed_is_one_prompt(tmp_path):
    """Lines end at a newline only: ``str.splitlines`` also broke them at U+2028/U+2029,
    form feeds, ``\\x85`` and other separators that sit inside text. A plain-text
    prompt holding one became two prompts (two generations, each from a piece of it),
    silently; a JSONL line with a raw U+2028 in a string (``json.dumps(...,
    ensure_ascii=False)``) was refused as not JSON."""
    from kvtrain.inference.generate import read_prompts

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"id": 1, "prompt": "a\u2028b"}, ensure_ascii=False) + "\n"
                     + json.dumps("c\u2029d", ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_prompts([], str(jsonl)) == [("a\u2028b", {"id": 1}), ("c\u2029d", {})]
    text = tmp_path / "p.txt"
    text.write_text("page 1\x0cpage 2\r\nnext\x85line\x1eend\n\x0b\n", encoding="utf-8")
    assert read_prompts([], str(text)) == [("page 1\x0cpage 2", {}),
                                           ("next\x85line\x1eend", {})]


def test_the_samples_of_two_seeds_share_no_prompt_stream(mp1, arm_runs):
    """Prompt i drew from a generator seeded seed + i: ``--seed 2``'s prompt 0 drew
    what ``--seed 1``'s prompt 1 did, so a prompt repeated n times and sampled again
    with the next seed gave n - 1 of the same samples. Each prompt's stream comes from
    (seed, index) now; a prompt's sample still does not depend on its batch."""
    from kvtrain.inference.generate import SamplingOptions, generate_ids

    loaded, codec = load(arm_runs["kv_shift"])
    args = (codec.eod, codec.vocab_size)
    samples = {}
    for seed in (1, 2):
        hot = SamplingOptions(max_new_tokens=8, temperature=5.0, seed=seed, stop_at_eod=False)
        samples[seed] = [t for t, _ in generate_ids(loaded.model, [PROMPTS[1]] * 4, hot, *args)]
        assert generate_ids(loaded.model, [PROMPTS[1]], hot, *args, first_index=2)[0][0] \
            == samples[seed][2]
    every = samples[1] + samples[2]
    assert len({tuple(t) for t in every}) == len(every), every


def test_a_prompt_field_that_out_writes_itself_is_one_line(mp1, arm_runs, tmp_path, capsys):
    """A JSONL prompt's other fields are copied to --out, but one named as a field
    --out writes (a reference answer as ``text``, a per-prompt ``seed``) was
    overwritten there by the generation's, silently: the reference lost, the seed
    not the one used. With --out it is refused in one line, before the model is
    loaded; without --out nothing is written, and it is taken."""
    from kvtrain.commands.generate import OUT_FIELDS

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "5 6", "id": "q1"}) + "\n"
                       + json.dumps({"prompt": "5 6 7", "text": "8 9 10", "id": "q2"}) + "\n")
    out = tmp_path / "g.jsonl"
    argv = ["generate", str(arm_runs["kv_shift"]), "--prompts", str(prompts),
            "--max-new-tokens", "2"]
    assert main([*argv, "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvtrain: config error: --prompts {prompts} line 2: its field \"text\" is one "
        "--out writes itself: rename it (its other fields are copied as they are)")
    assert not out.exists()
    assert main(argv) == 0
    prompts.write_text(json.dumps({"prompt": "5 6", "id": "q1", "answer": "7 8"}) + "\n")
    assert main([*argv, "--out", str(out)]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (record["id"], record["answer"], record["prompt"]) == ("q1", "7 8", "5 6")
    assert set(record) == {"id", "answer", *OUT_FIELDS}  # the fields --out writes: all named
