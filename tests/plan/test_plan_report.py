"""``kvtrain plan``'s printed report (in-process): the advice of a refused layout,
the memory warning, and the attention line for document masks, KV-shift head
selections and MLA. Each printed claim is checked against what the plan computes."""

from __future__ import annotations

import pytest

from kvtrain.cli import main
from kvtrain.config import load_config
from kvtrain.plan import make_plan
from kvtrain.plan.memory import GiB

from ..launch.conftest import REPO

PAPER = REPO / "configs" / "paper"
TINY = REPO / "configs" / "tiny.yaml"


def plan(capsys, config, *args: str, sets=()) -> tuple[int, str, str]:
    code = main(["plan", str(config), *args, *[x for s in sets for x in ("--set", s)]])
    out = capsys.readouterr()
    return code, out.out, out.err


# the 6.7B at TP 1 with full recompute: only the distributed optimizer's sharded
# states bring it under the card
NO_DISTOPT = ["parallel.tensor=1", "parallel.sequence_parallel=false", "parallel.recompute=full",
              "parallel.distributed_optimizer=false", "parallel.overlap_param_gather=false"]


def test_a_layout_over_the_card_names_the_setting_that_would_fit(capsys):
    """The user's mistake: a layout whose states do not fit (no distributed
    optimizer). The one line names the setting that fits, and that setting does
    plan at the memory the line gives."""
    path = PAPER / "6.7b_kv_shift.yaml"
    code, out, err = plan(capsys, path, "--nodes", "8", sets=NO_DISTOPT)
    assert code == 1 and out == ""
    assert err == (f"kvtrain plan: {path}: layout refused: estimated 129.9 GiB per GPU (stage "
                   "0: states 113.5, activations 7.4) exceeds the 80 GiB of each A100-80G; "
                   "parallel.distributed_optimizer=true would need 51.7 GiB\n")
    advised = NO_DISTOPT[:3] + ["parallel.distributed_optimizer=true"]
    fits = make_plan(load_config(path, advised), nodes=8, gpu="a100")
    assert f"{fits.memory.total / GiB:.1f}" == "51.7" and fits.fits


def test_a_layout_no_single_setting_fixes_says_to_split_the_model(capsys):
    """The 19B at TP 1, PP 1: no recompute or optimizer setting brings it under
    the card, so the line says to split the model (or the micro batch)."""
    path = PAPER / "19b_kv_shift.yaml"
    sets = ["parallel.tensor=1", "parallel.sequence_parallel=false", "parallel.pipeline=1",
            "parallel.recompute=full"]
    code, out, err = plan(capsys, path, "--nodes", "30", "--gpu", "a800", sets=sets)
    assert code == 1 and out == ""
    assert err.endswith("exceeds the 80 GiB of each A800-80G; raise parallel.tensor (with "
                        "sequence_parallel) or parallel.pipeline, or lower "
                        "train.micro_batch_size\n"), err
    assert err.count("\n") == 1


def test_a_layout_near_the_card_is_planned_with_a_warning(capsys):
    """40 layers of the 6.7B's width fit an 80 GiB card with 4% to spare: planned
    (exit 0), with the warning line giving the share the total line shows."""
    path = PAPER / "6.7b_kv_shift.yaml"
    code, out, err = plan(capsys, path, "--nodes", "8",
                          sets=["train.micro_batch_size=8", "model.num_layers=40"])
    assert code == 0 and err == ""
    total = make_plan(load_config(path, ["train.micro_batch_size=8", "model.num_layers=40"]),
                      nodes=8).memory.total
    share = f"{total / (80 * GiB):.0%}"
    assert share == "96%" and f"  total            77.2 GiB   of 80 GiB ({share})" in out
    assert out.splitlines()[-1] == (f"warning      estimated memory is {share} of the card: "
                                    "little headroom for fragmentation")


def _attention_line(capsys, config, sets) -> tuple[str, str]:
    """The plan's first line (the attention in words) and its attention-memory line."""
    code, out, err = plan(capsys, config, "--gpus-per-node", "1", sets=sets)
    assert code == 0, err
    lines = out.splitlines()
    (memory,) = [line for line in lines if line.startswith("  attention memory: ")]
    return lines[0], memory


@pytest.mark.parametrize("sets, why", [
    (["model.attention_dropout=0.1"], "; documents: SDPA with a [b, 1, s, s] mask per micro "
                                      "batch (not counted: attention_dropout > 0)"),
    (["model.num_attention_heads=8", "model.num_query_groups=4"],
     "; documents: SDPA with a [b, 1, s, s] mask per micro batch (not counted: heads of 8 < 16 "
     "channels)"),
    ([], "; documents: FlexAttention block mask"),  # 16-channel heads, no dropout
])
def test_the_document_mask_the_torch_backend_will_use_is_named(capsys, sets, why):
    """data.reset_attention_mask on the torch backend: FlexAttention on a GPU,
    except with attention dropout or heads too narrow for it, where SDPA takes a
    mask the memory estimate does not count (and says why)."""
    _, memory = _attention_line(capsys, TINY, ["model.backend=torch",
                                               "data.reset_attention_mask=true", *sets])
    assert memory == ("  attention memory: torch spec (model.backend torch): SDPA flash kernels, "
                      f"no s x s scores{why}")


@pytest.mark.parametrize("heads, shown", [
    ("{k: [1], fixed: true}", "[k heads [1], v all heads, fixed (0, 1)]"),
    ("{k: [0], v: [1], fixed: true}", "[k heads [0], v heads [1], fixed (0, 1)]"),
    ("{v: [0, 1]}", "[k all heads, v heads [0, 1]]"),
    ("{fixed: true}", "[all heads, fixed (0, 1)]"),
])
def test_the_shifted_heads_of_each_tensor_are_named(capsys, heads, shown):
    """model.kv_shift.heads selects heads per tensor; a shifted tensor it leaves
    null is shifted in every head. The plan named only the selected tensors
    ("[k heads [1], fixed (0, 1)]"), as if v were not shifted at all."""
    first, _ = _attention_line(capsys, TINY, ["model.kv_shift.window=1",
                                              f"model.kv_shift.heads={heads}"])
    assert first == ("plan for " + str(TINY) + ": tiny, KV shifting attention (shift k+v, "
                     f"window 1, free) {shown}")


@pytest.mark.parametrize("rank, query", [("128", "query rank 128"), ("null", "full-rank query")])
def test_mla_is_described_with_its_ranks_and_head_widths(capsys, rank, query):
    path = PAPER / "mla_kv_shift.yaml"
    first, _ = _attention_line(capsys, path, [f"model.mla.q_lora_rank={rank}"])
    assert first.endswith(", multi-latent attention (K/V latent 256, " + query
                          + ", head dims 32+32 RoPE / V 64)"), first


def test_an_h200_has_an_h100s_compute_and_the_memory_to_fit_more(capsys):
    """--gpu h200 (the card benchmarks/device measures on): an H100's dense bf16 peak,
    so the same step time, and 139 GiB, so the layout refused on 80 GiB above plans."""
    path = PAPER / "6.7b_kv_shift.yaml"
    code, out, err = plan(capsys, path, "--nodes", "8", "--gpu", "h200", sets=NO_DISTOPT)
    assert code == 0 and err == ""
    assert "64 x H200-141G = 8 node(s) x 8; 989 TFLOP/s bf16 and 139 GiB each" in out
    assert "total           129.9 GiB   of 139 GiB (93%)" in out
    cfg = load_config(path, [])
    h100, h200 = (make_plan(cfg, nodes=8, gpu=gpu) for gpu in ("h100", "h200"))
    assert h200.step_seconds == h100.step_seconds and h200.memory.total == h100.memory.total


def test_a_b200_plans_at_its_own_peak_and_memory(capsys):
    """--gpu b200 (HGX B200, 1,000 W): 2,250 dense bf16 TFLOP/s and the ~178 GiB
    PyTorch is given of its 180 GB, so the same layout steps 2250/989 x faster than
    on an H100; and a layout over it is refused naming the card."""
    path = PAPER / "6.7b_kv_shift.yaml"
    code, out, err = plan(capsys, path, "--nodes", "8", "--gpu", "b200", sets=NO_DISTOPT)
    assert code == 0 and err == ""
    assert "64 x B200-180G = 8 node(s) x 8; 2250 TFLOP/s bf16 and 178 GiB each" in out
    cfg = load_config(path, [])
    h100, b200 = (make_plan(cfg, nodes=8, gpu=gpu) for gpu in ("h100", "b200"))
    assert b200.step_seconds == pytest.approx(h100.step_seconds * 989 / 2250, rel=1e-12)
    code, out, err = plan(capsys, path, "--nodes", "8", "--gpu", "b200",
                          sets=NO_DISTOPT + ["parallel.recompute=none"])
    assert code == 1 and out == ""
    assert "GiB of each B200-180G; " in err, err


def test_the_validations_time_is_counted_with_each_named_set(capsys):
    """Every train.eval_interval steps and once at the end where no interval falls,
    train.eval_iters forward-only global batches of the validation and of each
    data.valid_sets entry: a third of a training step's FLOPs each."""
    path = PAPER / "1.5b_kv_shift.yaml"
    sets = ["train.max_steps=2500", "train.eval_interval=1000", "train.eval_iters=20"]
    base = make_plan(load_config(path, sets))
    assert base.evaluations == 3  # 1000, 2000 and the end (2500)
    assert base.eval_seconds == pytest.approx(3 * 20 * base.step_seconds / 3, rel=1e-12)
    more = make_plan(load_config(path, sets + ["data.valid_sets.code=[c]",
                                               "data.valid_sets.web=[w]"]))
    assert more.eval_seconds == pytest.approx(3 * base.eval_seconds, rel=1e-12)
    code, out, _ = plan(capsys, path, sets=sets + ["data.valid_sets.code=[c]"])
    share = 2 * base.eval_seconds / base.total_seconds
    assert code == 0 and ("evaluation   3 validations x 20 batches x (1 + 1 data.valid_sets): "
                          in out) and f"({share:.1%} of the training time)" in out
    assert make_plan(load_config(path, sets[:1] + ["train.eval_interval=null"])).eval_seconds == 0
    code, out, _ = plan(capsys, path, sets=sets[:1] + ["train.eval_interval=null"])
    assert "evaluation   none (train.eval_interval null)" in out


def test_a_report_into_a_closed_pipe_ends_quietly():
    """``kvtrain plan CONFIG | head`` (any report piped into a reader that stops)
    ended in a BrokenPipeError traceback: the pipeline's ordinary end now, exit
    141 as coreutils' tools, nothing on stderr."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # `head` has read its lines and gone
    try:
        proc = subprocess.run([sys.executable, "-m", "kvtrain.cli", "plan",
                               str(REPO / "configs/demo.yaml"), "--gpus", "1"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize("sets, unused", [
    (["optimizer.min_lr=1e-5"], "optimizer.min_lr (1e-05)"),
    (["optimizer.lr_decay_steps=500"], "optimizer.lr_decay_steps (500)"),
    (["optimizer.wsd_decay_steps=100"], "optimizer.wsd_decay_steps (100)"),
    (["optimizer.min_lr=0", "optimizer.wsd_decay_steps=100"],
     "optimizer.min_lr (0), optimizer.wsd_decay_steps (100)"),
    (["optimizer.wsd_decay_style=cosine"], "optimizer.wsd_decay_style (cosine)"),
])
def test_schedule_keys_the_constant_schedule_does_not_read_are_a_warning(capsys, sets, unused):
    """A constant schedule (the paper's, kvtrain's default) holds optimizer.lr
    after the warmup: a floor or a decay length set with it trained as if unset,
    without a word. They are warned of (a sweep over schedules shares them)."""
    code, out, err = plan(capsys, TINY, "--gpus-per-node", "1", sets=sets)
    assert code == 0 and err == "", err
    assert (f"warning      {unused} not used: optimizer.lr_schedule constant keeps "
            "optimizer.lr after the warmup (cosine or wsd decay)") in out.splitlines(), out


def test_a_decay_length_cosine_does_not_read_is_a_warning(capsys):
    code, out, err = plan(capsys, TINY, "--gpus-per-node", "1",
                          sets=["optimizer.lr_schedule=cosine", "optimizer.min_lr=0",
                                "optimizer.wsd_decay_steps=9",
                                "optimizer.wsd_decay_style=exponential"])
    assert code == 0 and err == "", err
    assert [line for line in out.splitlines() if "not used" in line] == [
        "warning      optimizer.wsd_decay_steps (9), optimizer.wsd_decay_style (exponential) "
        "not used: optimizer.lr_schedule cosine decays from the warmup to "
        "optimizer.lr_decay_steps (wsd: its last steps)"], out


def test_a_token_budget_max_steps_cuts_short_is_a_warning(capsys):
    """train.train_tokens with train.max_steps left at its default (100): whichever
    comes first ends the run, and the plan said 100 steps, 1.3 % of the budget, without
    a word (a probe's). Null max_steps trains on the tokens; a smaller budget is quiet."""
    sets = ["train.train_tokens=1000000", "train.global_batch_size=8", "train.seq_length=32",
            "train.max_steps=100"]
    code, out, err = plan(capsys, TINY, "--gpus-per-node", "1", sets=sets)
    assert code == 0 and err == "", err
    assert ("warning      train.max_steps (100) ends the run before train.train_tokens "
            "(1,000,000 tokens: 3,907 steps): set train.max_steps: null to train on the "
            "tokens") in out.splitlines(), out
    for more in (["train.max_steps=null"], ["train.train_tokens=1000"]):
        code, out, err = plan(capsys, TINY, "--gpus-per-node", "1", sets=[*sets, *more])
        assert code == 0 and "train.train_tokens (" not in out, out


def test_shards_a_data_type_of_its_own_sequences_never_reads_are_a_warning(capsys):
    """--set data.type=mock over a config of shards (a benchmark's, a smoke run's): its
    data.paths and data.split are not read, said; the shards' type says nothing."""
    demo = REPO / "configs" / "demo.yaml"
    code, out, err = plan(capsys, demo, "--gpus-per-node", "1", sets=["data.type=mock"])
    assert code == 0 and err == "", err
    assert ("warning      data.paths and data.split not read: data.type mock makes its own "
            "sequences (data.type: gpt trains on the shards)") in out.splitlines(), out
    code, out, err = plan(capsys, demo, "--gpus-per-node", "1")
    assert code == 0 and "not read" not in out, out
