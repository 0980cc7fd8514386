#!/usr/bin/env bash
# Launch `kvtrain train` under torchrun on this node: one process per GPU (or
# per CPU share on a CPU-only machine), on one node or as one node of many.
#
#   launch/torchrun.sh CONFIG [KEY=VALUE ...] [--run-dir DIR] [other `kvtrain train` args]
#
# KEY=VALUE arguments become `--set KEY=VALUE` overrides; anything else is passed
# to `kvtrain train` as is. The run folder (--run-dir, else $RUN_DIR, else the
# config's run_dir, else runs/<name>) receives the trainer's outputs; this
# script's per-node logs go to $LOG_DIR (default <run folder>/logs).
#
# Environment (all optional):
#   NPROC_PER_NODE   processes on this node (default: visible GPUs - none where
#                    CUDA_VISIBLE_DEVICES is empty or -1 - else SLURM_CPUS_ON_NODE, else 1)
#   NNODES           nodes (default: SLURM_NNODES, else 1)
#   NODE_RANK        this node's rank (default: SLURM_NODEID, else 0); used by
#                    the static rendezvous only
#   RDZV_ENDPOINT    host:port of a c10d rendezvous (any node can join; the
#                    host runs the store); with RDZV_ID (default: SLURM_JOB_ID
#                    or the run name)
#   MASTER_ADDR, MASTER_PORT   static rendezvous on node 0 when RDZV_ENDPOINT
#                    is unset and NNODES > 1 (default port 29500)
#   PYTHON           interpreter (default: $VIRTUAL_ENV or the repo's .venv, else python3)
#   LOG_DIR          folder of the node logs node<NODE_RANK>.log (default <run folder>/logs)
#   STOP_FILE        a path: when it appears, stop as on SIGUSR1 (slurm.sbatch's relay)
#   KVTRAIN_CHECKPOINT_DIR  the checkpoint folder slurm.sbatch took for a container
#                    job: a config whose checkpoint folder is another is refused
#   KVTRAIN_DRY_RUN=1  check the config, print the torchrun command and exit
#
# Single node:   launch/torchrun.sh configs/demo.yaml train.max_steps=20
# Two nodes:     RDZV_ENDPOINT=node0:29400 NNODES=2 launch/torchrun.sh CONFIG   (on both)
#   or static:   MASTER_ADDR=node0 NNODES=2 NODE_RANK=0|1 launch/torchrun.sh CONFIG
#
# Stopping: SIGUSR1 or SIGTERM to this script (or STOP_FILE appearing) makes it
# send SIGUSR1 to the trainer processes - torchrun's children, not torchrun and
# not the trainer's own helper processes - which save a checkpoint at the next
# step boundary and exit 0; `checkpoint.resume: auto` continues from there.
# Ctrl-C (SIGINT) does the same, and a second Ctrl-C quits at once, without
# that checkpoint. torchrun runs with SIGUSR1, SIGINT and SIGTERM ignored so
# that a signal to the whole process tree - SLURM's `scancel --signal` without
# --batch, a time limit, a terminal's Ctrl-C - does not make it tear the
# workers down first.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() { sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "torchrun.sh: $*" >&2; exit 2; }
# shellcheck source=SCRIPTDIR/folders.sh
source "$REPO/launch/folders.sh"  # check_folder

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
case $1 in -h|--help) usage; exit 0 ;; esac
CONFIG=$1
shift
[[ -f $CONFIG ]] || die "config not found: $CONFIG"

# ---------------------------------------------------------------- arguments
SETS=()       # --set KEY=VALUE pairs, for the trainer and the run-folder lookup
PASS=()       # other trainer arguments
RUN_DIR_KEY=${RUN_DIR:+RUN_DIR}  # where the run folder came from, for the pre-check's refusal
while [[ $# -gt 0 ]]; do
    case $1 in
        --run-dir) [[ $# -ge 2 ]] || die "--run-dir needs a value"
                   RUN_DIR=$2; RUN_DIR_KEY=--run-dir; shift 2 ;;
        --run-dir=*) RUN_DIR=${1#--run-dir=}; RUN_DIR_KEY=--run-dir; shift ;;
        --set) [[ $# -ge 2 ]] || die "--set needs KEY=VALUE"; SETS+=(--set "$2"); shift 2 ;;
        --set=*) SETS+=(--set "${1#--set=}"); shift ;;
        [A-Za-z_]*=*) SETS+=(--set "$1"); shift ;;
        *) PASS+=("$1"); shift ;;
    esac
done

# ---------------------------------------------------------------- interpreter
if [[ -z ${PYTHON:-} ]]; then
    if [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then
        PYTHON=$VIRTUAL_ENV/bin/python
    elif [[ -x $REPO/.venv/bin/python ]]; then
        PYTHON=$REPO/.venv/bin/python
    else
        PYTHON=python3
    fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# ---------------------------------------------------------------- topology
count_gpus() {
    # Set but empty (or -1) hides every GPU: how train.device cpu runs on a GPU
    # node (schema.py). CUDA stops at the first invalid id, so count up to it.
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        local ids id n=0
        IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
        for id in ${ids[@]+"${ids[@]}"}; do  # bash < 4.4: an empty array is unset
            [[ -n $id && $id != -* ]] || break
            n=$(( n + 1 ))
        done
        echo "$n"
    elif [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
        echo "$SLURM_GPUS_ON_NODE"
    elif command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}
GPUS=$(count_gpus)
GPUS=${GPUS:-0}
if [[ -z ${NPROC_PER_NODE:-} ]]; then
    if (( GPUS > 0 )); then
        NPROC_PER_NODE=$GPUS
    else
        NPROC_PER_NODE=${SLURM_CPUS_ON_NODE:-1}
    fi
fi
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
[[ $NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive integer, got '$NPROC_PER_NODE'"
[[ $NNODES =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
WORLD_SIZE=$(( NNODES * NPROC_PER_NODE ))

# ---------------------------------------------------------------- run folder
# Resolves the run folder the trainer will use (~ expanded, as the trainer does)
# and checks, before anything starts or any folder is made, the arguments (with
# kvtrain train's own parser), the config (with the world size: divisibility of
# heads, layers, batch) and the run's folders (launch/precheck.sh).
FOLDERS=$(bash "$REPO/launch/precheck.sh" "$PYTHON" "$WORLD_SIZE" "${RUN_DIR:-}" \
          "${RUN_DIR_KEY:-}" "$CONFIG" "${SETS[@]}" "${PASS[@]}") || exit 2
[[ -n $FOLDERS ]] || exit 0  # --help: kvtrain train's was printed
RUN_DIR=${FOLDERS%%$'\n'*}
LOG_DIR=${LOG_DIR:-$RUN_DIR/logs}
check_folder LOG_DIR "$LOG_DIR"

# ---------------------------------------------------------------- environment
ncpu=${SLURM_CPUS_ON_NODE:-$(nproc)}
threads=$(( ncpu / NPROC_PER_NODE ))
(( threads >= 1 )) || threads=1
(( threads <= 16 )) || threads=16
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}  # time to save on SIGTERM
if (( GPUS > 0 )); then
    # megatron: one CUDA work queue keeps TP/SP communication ordered with compute.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
fi

# ---------------------------------------------------------------- rendezvous
RDZV=()
if [[ -n ${RDZV_ENDPOINT:-} ]]; then
    rdzv_id=${RDZV_ID:-${SLURM_JOB_ID:-$(basename "$RUN_DIR")}}
    RDZV=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$rdzv_id")
elif (( NNODES > 1 )); then
    [[ -n ${MASTER_ADDR:-} ]] || die "NNODES=$NNODES needs RDZV_ENDPOINT (c10d) or MASTER_ADDR (static)"
    RDZV=(--master-addr="$MASTER_ADDR" --master-port="${MASTER_PORT:-29500}" --node-rank="$NODE_RANK")
else
    RDZV=(--standalone)
fi

CMD=("$PYTHON" -m torch.distributed.run
     --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" "${RDZV[@]}" --max-restarts=0
     -m kvtrain.cli train "$CONFIG" --run-dir "$RUN_DIR" "${SETS[@]}" "${PASS[@]}")

if [[ ${KVTRAIN_DRY_RUN:-0} == 1 ]]; then
    printf 'NNODES=%s NODE_RANK=%s NPROC_PER_NODE=%s OMP_NUM_THREADS=%s RUN_DIR=%s LOG_DIR=%s\n' \
        "$NNODES" "$NODE_RANK" "$NPROC_PER_NODE" "$OMP_NUM_THREADS" "$RUN_DIR" "$LOG_DIR"
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi

# ---------------------------------------------------------------- launch
mkdir -p "$LOG_DIR"
LOG=$LOG_DIR/node$NODE_RANK.log
# Everything from here on is also appended to the node log. tee ignores SIGUSR1,
# SIGTERM and SIGINT: it must outlive a stop request, or the workers' next print
# would hit a broken pipe while they save.
exec > >(trap '' USR1 TERM INT; exec tee -a "$LOG") 2>&1
TEE_PID=$!
echo "=== $(date '+%F %T') $(hostname): node $NODE_RANK of $NNODES, $NPROC_PER_NODE process(es)," \
     "restart ${SLURM_RESTART_COUNT:-0}"
printf '%q ' "${CMD[@]}"
echo

# Who passes a stop request on to the workers (and only to them: torchrun,
# signalled, tears its workers down; the trainer's helper processes - data
# loader workers, the checkpoint writer - ignore the stop signals):
# * a signal to this script (kill, a scheduler): forwarded as SIGUSR1;
# * STOP_FILE appearing (launch/slurm.sbatch creates it when the batch shell
#   gets --signal=B:USR1@T): SIGUSR1.
# Either way the SIGUSR1 is repeated every 30 s until the workers exit, in case
# the first one came before the trainer had installed its handler.
# A signal that SLURM delivers to the whole step (`scancel --signal=USR1 JOB`
# without --batch) reaches the workers directly; FORWARD_SIGNALS=0 there.
if [[ -z ${FORWARD_SIGNALS:-} ]]; then
    if [[ -n ${SLURM_STEP_ID:-} ]]; then FORWARD_SIGNALS=0; else FORWARD_SIGNALS=1; fi
fi

# shellcheck disable=SC2317  # called from the signal trap
children_of() {  # direct children of pid $1 (the workers of torchrun)
    if command -v pgrep > /dev/null 2>&1; then
        pgrep -P "$1" || true
        return 0
    fi
    local stat rest pid ppid
    for stat in /proc/[0-9]*/stat; do
        rest=$(cat "$stat" 2> /dev/null) || continue
        pid=${rest%% *}
        rest=${rest##*) }
        ppid=$(cut -d' ' -f2 <<< "$rest")
        [[ $ppid == "$1" ]] && echo "$pid"
    done
    return 0
}

TORCHRUN_PID=""
STOPPING=0      # a stop was asked for (signal or stop file): the exit message
FORWARD=0       # the workers must be told (and told again every 30 s until they exit)
LAST_STOP=-1    # when SIGUSR1 last went to the workers (bash SECONDS)
# shellcheck disable=SC2317  # called from the signal trap and the loop
tell_workers() {
    [[ -n $TORCHRUN_PID ]] || return 0
    if (( LAST_STOP >= 0 && SECONDS - LAST_STOP < 30 )); then return 0; fi
    local pids
    pids=$(children_of "$TORCHRUN_PID")
    if [[ -n $pids ]]; then
        # shellcheck disable=SC2086  # one pid per word
        kill -s USR1 $pids 2> /dev/null || true
        LAST_STOP=$SECONDS
    fi
    return 0
}
# shellcheck disable=SC2317  # called from the signal trap
on_signal() {
    echo "torchrun.sh: SIG$1: the trainer saves a checkpoint at the next step boundary and exits" >&2
    STOPPING=1
    if [[ $FORWARD_SIGNALS == 1 ]]; then
        FORWARD=1
        tell_workers
    fi
    return 0
}
# Ctrl-C: the terminal's SIGINT reaches this script, tee and torchrun (which ignore
# it), not the workers (torchrun starts them in sessions of their own): they get
# it from here, and SIGUSR1 every 30 s for a start-up not yet listening (they
# inherit torchrun's ignored SIGINT until the trainer installs its handler). The
# trainer says the line; a second Ctrl-C quits them at once.
# shellcheck disable=SC2317  # called from the signal trap
on_interrupt() {
    STOPPING=1
    if [[ $FORWARD_SIGNALS == 1 && -n $TORCHRUN_PID ]]; then
        local pids
        pids=$(children_of "$TORCHRUN_PID")
        # shellcheck disable=SC2086  # one pid per word
        [[ -z $pids ]] || kill -s INT $pids 2> /dev/null || true
        FORWARD=1
        tell_workers
    fi
    return 0
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM
trap 'on_interrupt' INT

# torchrun ignores SIGUSR1, SIGINT and SIGTERM; the trainer installs its own
# handlers for them. The workers inherit the ignored signals until then, so a
# stop asked for during their start-up is not lost but repeated (every 30 s)
# until they act on it. torchrun's own handlers are set by --signals-to-handle
# (default SIGTERM,SIGINT,SIGHUP,SIGQUIT, or PET_SIGNALS_TO_HANDLE) in recent
# torch (2.13 here), by TORCHELASTIC_SIGNALS_TO_HANDLE in older: both are set.
export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGHUP,SIGQUIT}
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-$TORCHELASTIC_SIGNALS_TO_HANDLE}
( trap '' USR1 TERM INT; exec "${CMD[@]}" ) &
TORCHRUN_PID=$!

while kill -0 "$TORCHRUN_PID" 2> /dev/null; do
    if (( ! FORWARD )) && [[ -n ${STOP_FILE:-} && -e $STOP_FILE ]]; then
        echo "torchrun.sh: $STOP_FILE exists: the trainer saves a checkpoint and exits"
        STOPPING=1
        FORWARD=1
    fi
    if (( FORWARD )); then tell_workers; fi
    sleep 1 & wait $! || true   # a trapped signal interrupts the wait, not the loop
done
# The exit status. `wait` returns early (> 128) when a trapped signal arrives
# meanwhile: ask again while torchrun lives. A torchrun killed by a signal also
# gives > 128, and `wait` repeats a collected child's status: that is the answer.
rc=0
while :; do
    status=0
    wait "$TORCHRUN_PID" || status=$?
    (( status > 128 )) && kill -0 "$TORCHRUN_PID" 2> /dev/null && continue
    (( status == 127 )) || rc=$status  # 127: collected before, keep what we saw
    break
done
if (( STOPPING )); then
    echo "torchrun.sh: stopped on request, torchrun exit code $rc"
fi
# Let tee drain before exiting, so the log is complete when the caller looks.
exec > /dev/null 2>&1
for _ in $(seq 50); do kill -0 "$TEE_PID" 2> /dev/null || break; sleep 0.1; done
exit "$rc"
