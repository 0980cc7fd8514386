"""The paper's configs (Table 16, Appendix H) and `kvtrain plan`.

* every paper config builds on the meta device with the parameter count its
  name says (within 3%), and kvtrain.plan counts exactly what megatron builds,
  whole and per rank of a TP/PP layout;
* vanilla and KV-shift files of a size differ only in model.attention (and name);
* `kvtrain plan` accepts each at the GPU count its header states (the header's
  own "Check:" line) with the paper's batch in tokens, and refuses impossible
  layouts with one line.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from kvtrain.config import load_config, to_dict
from kvtrain.plan import count_params, make_plan, stage_params

from .conftest import REPO, VENV_BIN

# Table 16's sizes; the Appendix J pair (multi-latent attention) is MLA
PAPER = sorted(p for p in (REPO / "configs" / "paper").glob("*.yaml")
               if not p.stem.startswith("mla_"))
MLA = sorted((REPO / "configs" / "paper").glob("mla_*.yaml"))
BLAGPT = sorted((REPO / "configs" / "blagpt").glob("*.yaml"))
SIZES = {"1.5b": 1.5e9, "2.9b": 2.9e9, "6.7b": 6.7e9, "13b": 13e9, "19b": 19e9}
# The paper's batch sizes ("1M/16M/1M/2M/3M" tokens; 19B: 240 GPUs x 1 x 12288).
BATCH_TOKENS = {"1.5b": 2**20, "2.9b": 16 * 2**20, "6.7b": 2**20, "13b": 2 * 2**20,
                "19b": 240 * 12288}
GPUS = {"1.5b": 64, "2.9b": 512, "6.7b": 64, "13b": 128, "19b": 240}


def size_of(path) -> str:
    return path.stem.split("_", 1)[0]


def check_line(path) -> list[str]:
    """The `kvtrain plan ...` arguments from the config's '# Check:' header line."""
    m = re.search(r"^# Check: kvtrain plan (.+)$", path.read_text(), re.M)
    assert m, f"{path} has no '# Check: kvtrain plan ...' line"
    return shlex.split(m.group(1))


def kvtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "kvtrain"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_all_sizes_present_as_pairs():
    names = {p.stem for p in PAPER}
    assert names == {f"{s}_{a}" for s in SIZES for a in ("vanilla", "kv_shift")}
    assert {p.stem for p in BLAGPT} == {"vanilla", "kv_shift"}
    assert {p.stem for p in MLA} == {"mla_vanilla", "mla_kv_shift"}


@pytest.mark.parametrize("size", [*SIZES, "blagpt", "mla"])
def test_pairs_differ_only_in_attention(size):
    if size == "blagpt":
        van, kv = (REPO / "configs" / "blagpt" / f"{a}.yaml" for a in ("vanilla", "kv_shift"))
    elif size == "mla":
        van, kv = (REPO / "configs" / "paper" / f"mla_{a}.yaml" for a in ("vanilla", "kv_shift"))
    else:
        van, kv = (REPO / "configs" / "paper" / f"{size}_{a}.yaml" for a in ("vanilla", "kv_shift"))
    a, b = to_dict(load_config(van)), to_dict(load_config(kv))
    assert (a["model"]["attention"], b["model"]["attention"]) == ("vanilla", "kv_shift")
    assert a["name"] != b["name"]  # separate run folders
    for d in (a, b):
        d["model"]["attention"] = d["name"] = None
    assert a == b


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_config_follows_table16(path):
    cfg = load_config(path)
    m, t, o, p = cfg.model, cfg.train, cfg.optimizer, cfg.parallel
    size = size_of(path)
    assert m.rotary_base == 100000 and t.precision == "bf16"
    assert (o.lr_schedule, o.adam_beta1, o.adam_beta2, o.weight_decay) == ("constant", 0.9, 0.95, 0.1)
    assert t.max_steps is None and t.train_tokens
    assert t.seq_length == m.max_position_embeddings
    assert t.global_batch_size * t.seq_length == BATCH_TOKENS[size]
    assert p.distributed_optimizer
    if m.kv_heads != m.num_attention_heads:
        assert size in ("2.9b", "19b")  # the GQA models
    header = path.read_text().split("\nname:")[0]
    assert f"{GPUS[size]} x " in header and "Batch arithmetic" in header


@pytest.mark.parametrize("path", PAPER + BLAGPT + MLA, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_meta_build_matches_plan_and_name(mp1, path):
    """GPTModel on the meta device (no memory): megatron's count is the plan's, exactly."""
    import torch

    from kvtrain.config.schema import ParallelConfig
    from kvtrain.model.builder import build_gpt, count_parameters, transformer_config

    cfg = load_config(path)
    with torch.device("meta"):
        tc = transformer_config(cfg.model, ParallelConfig(), use_cpu_initialization=True,
                                perform_initialization=False)
        model = build_gpt(cfg.model, tc, seed=cfg.train.seed)
    assert next(model.parameters()).device.type == "meta"
    built = count_parameters(model)
    plan = count_params(cfg.model, 1)
    assert built == {"total": plan.total, "embedding": plan.embedding,
                     "non_embedding": plan.non_embedding}
    if path in PAPER:
        name = SIZES[size_of(path)]
        assert abs(built["total"] - name) / name < 0.03, (path.stem, built["total"])
    else:
        assert 0.10e9 < built["total"] < 0.2e9  # the paper's "0.2B model" (BlaGPT)


def _sharded_counts(rank, world, cases):
    """On each rank: the parameters of this rank's chunk, for each (config, overrides)."""
    import torch

    from kvtrain.backend import init_model_parallel, set_seed
    from kvtrain.model.builder import build_gpt, count_parameters, transformer_config
    from megatron.core import parallel_state as ps

    out = []
    for path, overrides in cases:
        cfg = load_config(path, overrides)
        init_model_parallel(cfg.parallel.tensor, cfg.parallel.pipeline)
        set_seed(1234)
        with torch.device("meta"):
            tc = transformer_config(cfg.model, cfg.parallel, use_cpu_initialization=True,
                                    perform_initialization=False)
            model = build_gpt(cfg.model, tc)
        out.append((ps.get_pipeline_model_parallel_rank(), count_parameters(model)["total"]))
    return out


@pytest.mark.slow
def test_per_rank_params_match_sharded_builds():
    """TP shards (2.9B and 6.7B at their own TP 2 + SP) and PP stages (19B, and 1.5B
    with its tied embeddings) hold what stage_params says, rank by rank."""
    from kvtrain.testing import run_distributed

    paper = REPO / "configs" / "paper"
    cases = [
        (str(paper / "2.9b_kv_shift.yaml"), []),
        (str(paper / "6.7b_vanilla.yaml"), []),
        (str(paper / "19b_kv_shift.yaml"),
         ["parallel.tensor=1", "parallel.sequence_parallel=false", "parallel.pipeline=2"]),
        (str(paper / "1.5b_vanilla.yaml"), ["parallel.pipeline=2"]),
    ]
    results = run_distributed(_sharded_counts, 2, cases, timeout=600)
    for i, (path, overrides) in enumerate(cases):
        cfg = load_config(path, overrides)
        expected = stage_params(cfg.model, cfg.parallel)
        for rank_results in results:
            pp_rank, total = rank_results[i]
            assert total == expected[pp_rank].params, (path, overrides, pp_rank)


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_plan_accepts_paper_config_at_its_gpu_count(path):
    args = check_line(path)
    out = kvtrain("plan", *args, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    size = size_of(path)
    assert plan["cluster"]["gpus"] == GPUS[size]
    assert plan["batch"]["tokens_per_step"] == BATCH_TOKENS[size]
    assert plan["memory_gib"]["total"] <= plan["memory_gib"]["card"]
    assert abs(plan["params"]["total"] / SIZES[size] - 1) < 0.03
    assert plan["steps"] > 0 and plan["days"] > 0


def test_plan_accepts_19b_context_parallel_variants():
    """The CP variants the 19B header documents (12288 and 32768 tokens) plan at 240
    GPUs with the paper's ~2.95M tokens a step, sharding the optimizer over DP x CP."""
    path = REPO / "configs" / "paper" / "19b_kv_shift.yaml"
    lines = re.findall(r"^# CP: kvtrain plan (.+)$", path.read_text(), re.M)
    assert len(lines) == 2
    for line in lines:
        argv = shlex.split(line)
        overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        cfg = load_config(REPO / argv[0], overrides)
        plan = make_plan(cfg, nodes=30, gpus_per_node=8, gpu="a800")
        p = cfg.parallel
        assert p.context > 1 and plan.world == 240 and plan.fits
        assert plan.dp * p.tensor * p.pipeline * p.context == 240
        assert plan.tokens_per_step == BATCH_TOKENS["19b"]
        assert cfg.train.seq_length >= 12288


@pytest.mark.parametrize("path", MLA, ids=lambda p: p.stem)
def test_plan_accepts_mla_config(path):
    """Appendix J: `kvtrain plan` takes the MLA pair at its header's GPU count and
    counts the parameters of MLA (and of the fixed shift: none)."""
    out = kvtrain("plan", *check_line(path), "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["batch"]["tokens_per_step"] == 2**19
    assert plan["params"]["total"] == count_params(load_config(path).model).total


def test_plan_text_report():
    out = kvtrain("plan", "configs/paper/19b_kv_shift.yaml", "--nodes", "30", "--gpu", "a800")
    assert out.returncode == 0, out.stderr
    for needle in ("parameters", "non-embedding", "TP 4 x PP 2 x CP 1 x DP 30",
                   "global 240 sequences = micro 1 x DP 30 x 8 accumulation",
                   "weights", "optimizer", "activations", "recompute full",
                   "distributed optimizer off", "FLOPs per step", "days"):
        assert needle in out.stdout, needle


@pytest.mark.parametrize("args, code, message", [
    # 232 GPUs: DP 29 does not divide the 240-sequence batch
    (["configs/paper/19b_kv_shift.yaml", "--nodes", "29", "--gpu", "a800"], 1,
     "train.global_batch_size 240 is not a multiple"),
    # GPUs that do not divide into TP x PP
    (["configs/paper/13b_kv_shift.yaml", "--nodes", "1", "--gpus-per-node", "6"], 1,
     "do not divide into TP 4"),
    # memory: the 2.9B at TP 1 without recompute
    (["configs/paper/2.9b_kv_shift.yaml", "--nodes", "64", "--gpu", "h800",
      "--set", "parallel.tensor=1", "--set", "parallel.sequence_parallel=false"], 1,
     "exceeds the 80 GiB"),
    # divisibility of the model itself: 40 heads over TP 3
    (["configs/paper/13b_vanilla.yaml", "--nodes", "16", "--set", "parallel.tensor=3"], 2,
     "must be divisible by parallel.tensor (3)"),
    # MLA over TP without SP on te (what auto plans for a GPU): refused as at start
    (["configs/paper/mla_kv_shift.yaml", "--set", "parallel.tensor=2"], 1,
     "model.mla with parallel.tensor 2 on model.backend te (the backend is te: model.backend "
     "auto, planned as te) needs parallel.sequence_parallel: true"),
    # the cluster and the assumed MFU
    (["configs/paper/1.5b_kv_shift.yaml", "--nodes", "0"], 1,
     "--nodes (0) and --gpus-per-node (8) must be >= 1"),
    (["configs/paper/1.5b_kv_shift.yaml", "--mfu", "1.5"], 1, "--mfu must be in (0, 1], got 1.5"),
])
def test_plan_refuses_impossible_layouts_in_one_line(args, code, message):
    out = kvtrain("plan", *args)
    assert out.returncode == code, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("sets, nodes, gpus_per_node, warning", [
    (["parallel.tensor=8"], 2, 4,
     "TP 8 spans nodes (4 GPUs per node): tensor-parallel all-reduces would cross the network"),
    (["parallel.tensor=4", "train.global_batch_size=480"], 2, 6,
     "TP 4 does not divide the 6 GPUs of a node: some TP groups span two nodes"),
    (["parallel.pipeline=4", "train.global_batch_size=64"], 2, 8,
     "2 micro batches per step for PP 4: the pipeline bubble dominates (want micro batches "
     ">= 4 x PP)"),
    (["parallel.tensor=2", "train.precision=fp32", "parallel.recompute=full"], 1, 8,
     "train.precision fp32 on GPU (tf32 matmuls): bf16 is the paper's setting and its peak "
     "is 2x higher"),
    (["train.train_tokens=null", "train.max_steps=800"], 1, 8,
     "optimizer.lr_warmup_steps (1000) is longer than the run (800 steps): the LR never "
     "reaches optimizer.lr (0.0002); its last step trains at 0.00016"),
])
def test_plan_warns_of_layouts_that_work_badly(sets, nodes, gpus_per_node, warning):
    """Layouts that run but waste the cluster: the plan's one warning each (the paper's
    1.5B config otherwise gives none)."""
    path = str(REPO / "configs/paper/1.5b_kv_shift.yaml")
    assert make_plan(load_config(path, []), nodes=1, gpus_per_node=8).warnings == []
    plan = make_plan(load_config(path, sets), nodes=nodes, gpus_per_node=gpus_per_node)
    assert plan.warnings == [warning]


def test_plan_memory_is_monotone_in_the_obvious_knobs():
    path = REPO / "configs/paper/6.7b_kv_shift.yaml"

    def plan(*sets):
        return make_plan(load_config(path, list(sets)), nodes=8, gpu="a100")

    default = plan()
    mem, alt = default.memory, default.memory.alternatives
    assert default.cfg.parallel.recompute == "none"
    assert alt["recompute full"] < mem.total == alt["recompute none"] < alt[
        "distributed optimizer off"]
    assert alt["recompute selective"] == mem.total  # flash attention keeps no s x s scores
    assert plan("parallel.tensor=4").memory.total < mem.total
    smaller = plan("train.micro_batch_size=4").memory
    assert smaller.activations < mem.activations and smaller.states == mem.states


@pytest.mark.parametrize("path", PAPER + BLAGPT, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_plan_flops_and_steps_are_the_trainers(path):
    from kvtrain.plan.flops import step_flops
    from kvtrain.train.flops import training_flops_per_step
    from kvtrain.config.layout import derive_layout

    cfg = load_config(path)
    t = cfg.train
    v = cfg.model.padded_vocab_size(cfg.parallel.tensor)
    ours = step_flops(cfg.model, t.seq_length, t.global_batch_size, cfg.parallel.tensor)
    theirs = training_flops_per_step(cfg.model, t.seq_length, t.global_batch_size, v)
    assert ours.model == pytest.approx(theirs, rel=1e-12)
    nodes = {"1.5b": 8, "2.9b": 64, "6.7b": 8, "13b": 16, "19b": 30}.get(size_of(path), 1)
    plan = make_plan(cfg, nodes=nodes, gpu="a800")
    assert plan.steps == derive_layout(cfg, plan.world).total_steps


def test_plan_runs_without_torch():
    code = ("import sys; from kvtrain.cli import main; "
            "rc = main(['plan', 'configs/paper/1.5b_vanilla.yaml', '--nodes', '8']); "
            "assert 'torch' not in sys.modules, 'plan imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
