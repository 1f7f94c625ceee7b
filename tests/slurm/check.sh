#!/usr/bin/env bash
# The documented SLURM job scripts (docs/preemption.md's two, docs/clusters.md's torchrun one) under a real SLURM, stopped by their
# warning signal, requeued and resumed: each must stop every rank at one step with a checkpoint, be requeued, resume
# from that step and end with the same weights, bit for bit, as the same script never stopped. Not part of the pytest
# suite: it needs root and apt (it installs Debian's slurm-wlm and munge where missing) and takes 6 to 7 minutes;
# docs/clusters.md says what it does, docs/reliability.md what it found.
#
#   tests/slurm/check.sh [--readme FILE] [--time-limit MINUTES STEPS] [one_node] [several_nodes] [torchrun]
#
# (default: this checkout's docs/preemption.md, which holds the two job scripts (--readme FILE: another file holding
# them, such as an older README), all three scripts, the warning sent at once; --time-limit submits the stopped job
# with that time limit and trains STEPS steps, long enough for SLURM's own warning to come, maybe more than once)
#
# It stands up a one-host cluster (munged, slurmctld, two slurmd as nodes n1 and n2 of 2 CPUs each, state and logs in
# a scratch directory), runs each script twice at once, a reference and one it stops, and tears the cluster down.
# The stop is SLURM's own warning, delivered now: `scancel --batch --signal=USR1` is what `--signal=B:USR1@120` sends
# the batch script; the 2-minute hold of a requeued job is lifted with `scontrol update StartTime=now`.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
README=$ROOT/docs/preemption.md  # the file holding the two job scripts (README's, before issue 50)
SCRIPTS=()
TIME_LIMIT=  # minutes; empty: the warning is sent at once instead
STEPS=200
while [ $# -gt 0 ]; do
    case $1 in
        --readme) README=$(realpath "$2"); shift 2 ;;
        --time-limit) TIME_LIMIT=${2:?--time-limit takes MINUTES STEPS}; STEPS=${3:?--time-limit takes MINUTES STEPS}; shift 3 ;;
        one_node|several_nodes|torchrun) SCRIPTS+=("$1"); shift ;;
        *) echo "usage: $0 [--readme FILE] [--time-limit MINUTES STEPS] [one_node] [several_nodes] [torchrun]" >&2; exit 2 ;;
    esac
done
[ ${#SCRIPTS[@]} -gt 0 ] || SCRIPTS=(one_node several_nodes torchrun)
[ "$(id -u)" = 0 ] || { echo "error: $0 starts SLURM's daemons and edits /etc/hosts: run it as root" >&2; exit 2; }

WORK=$(mktemp -d /tmp/mpp-slurm-check.XXXXXX)
export SLURM_CONF=$WORK/slurm.conf
HOSTS_LINE="127.0.0.1 n1 n2  # mpp tests/slurm/check.sh"
STARTED=()  # pid files of the daemons this script started, stopped at its end
T0=$(date +%s)

say() { echo "[$(($(date +%s) - T0)) s] $*"; }
fail() { say "FAILED: $*"; exit 1; }

install_slurm() {
    if command -v slurmctld >/dev/null && command -v munged >/dev/null; then return; fi
    say "installing slurm-wlm and munge"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged
    STARTED+=(/run/munge/munged.pid)
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.2; done
    fail "munged did not start (munge -n | unmunge)"
}

write_config() {
    mkdir -p "$WORK/state" "$WORK/spool"
    cat > "$SLURM_CONF" <<CONF
ClusterName=mppcheck
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=16817
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool/%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.%n.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
KillWait=30
ReturnToService=2
NodeName=n1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=17001 CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=17002 CPUs=2 State=UNKNOWN
PartitionName=check Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
}

start_slurm() {
    grep -qF "$HOSTS_LINE" /etc/hosts || echo "$HOSTS_LINE" >> /etc/hosts  # the scripts resolve node names
    slurmctld && STARTED+=("$WORK/slurmctld.pid")
    for node in n1 n2; do slurmd -N $node && STARTED+=("$WORK/slurmd.$node.pid"); done
    for _ in $(seq 60); do
        [ "$(sinfo -h -N -o %T 2>/dev/null | sort -u)" = idle ] && return
        sleep 1
    done
    fail "the nodes did not come up: $(sinfo -N 2>&1)"
}

stop_slurm() {
    local status=$?
    if [ -f "$WORK/slurmctld.pid" ]; then
        scancel --quiet --partition=check || true
        for _ in $(seq 60); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 1; done
    fi
    for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do
        [ -f "${STARTED[i]}" ] && kill "$(cat "${STARTED[i]}")" 2>/dev/null || true
    done
    grep -vF "$HOSTS_LINE" /etc/hosts > "$WORK/hosts" && cat "$WORK/hosts" > /etc/hosts  # a bind mount: no rename
    if [ $status = 0 ]; then rm -rf "$WORK"; else say "logs and runs kept in $WORK"; fi
}

job_field() { scontrol show job "$1" -o | grep -o "$2=[^ ]*" | cut -d= -f2; }

wait_for() {  # description, seconds, command...
    local what=$1 seconds=$2; shift 2
    for _ in $(seq "$seconds"); do "$@" && return; sleep 1; done
    fail "$what: not within $seconds s"
}
in_state() { [ "$(job_field "$1" JobState)" = "$2" ]; }
has_checkpoint() { compgen -G "$1/checkpoints/step_*/manifest.json" >/dev/null; }

submit() {  # name run
    sbatch --parsable --chdir="$ROOT" --output="$WORK/$1_$2.log" "$WORK/$1_$2.sbatch"
}

lift_hold() {  # job: a requeued job waits about 2 minutes (Reason=BeginTime); start it now
    if in_state "$1" PENDING && [ "$(job_field "$1" Reason)" = BeginTime ]; then
        say "$name: job $1 requeued (Restarts=$(job_field "$1" Restarts), StartTime=$(job_field "$1" StartTime)); starting it now"
        scontrol update jobid="$1" StartTime=now
    fi
}

run_both() {  # name: a reference job and one stopped by its warning (sent now, or by SLURM at the time limit)
    reference=$(submit "$name" reference)
    if [ -n "$TIME_LIMIT" ]; then
        stopped=$(sbatch --parsable --time="$TIME_LIMIT" --chdir="$ROOT" --output="$WORK/${name}_stopped.log" \
                  "$WORK/${name}_stopped.sbatch")
        say "$name: jobs $reference (never stopped) and $stopped (--time=$TIME_LIMIT: SLURM's warning), $processes processes each"
    else
        stopped=$(submit "$name" stopped)
        say "$name: jobs $reference (never stopped) and $stopped (stopped), $processes processes each"
        wait_for "$name: a first checkpoint" 600 has_checkpoint "$WORK/${name}_stopped"
        scancel --batch --signal=USR1 "$stopped"  # what --signal=B:USR1@120 sends the batch script
        say "$name: SIGUSR1 sent to job $stopped's batch script"
        wait_for "$name: job $stopped requeued" 300 in_state "$stopped" PENDING
    fi
    for _ in $(seq 1800); do
        lift_hold "$stopped"
        in_state "$reference" COMPLETED && in_state "$stopped" COMPLETED && return
        for job in "$reference" "$stopped"; do
            case $(job_field "$job" JobState) in FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)
                fail "$name: job $job ended $(job_field "$job" JobState) ($WORK/${name}_*.log)" ;;
            esac
        done
        sleep 1
    done
    fail "$name: the jobs did not complete within 30 minutes"
}

steps_of() {  # log pattern: "count step" for each step the pattern names (each rank prints its own line)
    grep -o "$2" "$1" | grep -o "step [0-9]*" | awk '{print $2}' | sort -n | uniq -c || true
}

check_script() {  # name processes
    local name=$1 processes=$2 reference stopped log stops resumes restarts
    run_both
    log=$WORK/${name}_stopped.log
    # Every stop: all ranks at one step, with a checkpoint there. Every requeued job resumes from a stop's step, or
    # finds the run finished (a warning that came after its last step): a resume from an older checkpoint would mean
    # a stop that saved nothing, as the several-nodes script before issue 48 did.
    stops=$(steps_of "$log" "stopped at step [0-9]* of $STEPS on a signal; checkpoint saved")
    resumes=$(steps_of "$log" "resumed from [^ ]* at step [0-9]*" | awk '{print $2}')  # printed once per node
    restarts=$(job_field "$stopped" Restarts)
    [ -n "$stops" ] || fail "$name: no rank stopped with a checkpoint ($log)"
    echo "$stops" | awk -v n="$processes" '$1 != n {exit 1}' \
        || fail "$name: expected all $processes ranks to stop at one step with a checkpoint, got: $stops ($log)"
    [ -n "$resumes" ] && [ "$(echo "$resumes" | wc -l)" = "$restarts" ] \
        || fail "$name: $restarts requeue(s), but the run resumed from: ${resumes:-nothing} ($log)"
    for step in $resumes; do
        [ "$step" = "$STEPS" ] || echo "$stops" | awk -v s="$step" '$2 == s {found = 1} END {exit !found}' \
            || fail "$name: a requeued job resumed from step $step, where no stop saved ($log)"
    done
    ! grep -q "forcing job termination" "$log" || fail "$name: srun killed the job step ($log)"
    say "$name: requeued $restarts time(s); stopped with a checkpoint at step(s) $(echo "$stops" | awk '{print $2}' | paste -sd,), resumed from step(s) $(echo "$resumes" | paste -sd,)"
    python "$ROOT/tests/slurm/scripts.py" same-weights "$WORK/${name}_reference/model.safetensors" \
        "$WORK/${name}_stopped/model.safetensors" || fail "$name: the stopped run's weights differ"
}

trap stop_slurm EXIT
trap 'exit 130' INT TERM  # through the EXIT trap: the daemons stopped, /etc/hosts restored
install_slurm
python "$ROOT/tests/slurm/scripts.py" write "$README" "$WORK"
sed -i "s/steps: 200,/steps: $STEPS,/" "$WORK/tiny.yaml"
python "$ROOT/launch.py" prepare synthetic --count 200 --size 16 --out "$WORK/shards" >/dev/null 2>&1
start_munge
write_config
start_slurm
say "SLURM $(sinfo -V | cut -d' ' -f2) up: nodes $(sinfo -h -N -o %N | paste -sd,), scratch $WORK"
declare -A PROCESSES=([one_node]=2 [several_nodes]=2 [torchrun]=2)
for name in "${SCRIPTS[@]}"; do check_script "$name" "${PROCESSES[$name]}"; done
say "passed: ${SCRIPTS[*]}"
