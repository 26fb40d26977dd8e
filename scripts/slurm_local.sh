#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the launcher tests (and for trying a sweep by hand).
#
#   scripts/slurm_local.sh start [DIR]   # munged + slurmctld + slurmd; waits until the node is idle
#   export SLURM_CONF=DIR/slurm.conf      # what sinfo/sbatch/submitit need (start prints it)
#   scripts/slurm_local.sh stop [DIR]    # lets running jobs finish (20 s), cancels the rest, stops the
#                                        # daemons `start DIR` started and any job step they left behind
#
# Everything lives under DIR (default /tmp/harness-slurm): its own munge key and socket, slurm.conf,
# spool/state directories, logs and pid files, on free ports. Nothing under /etc is touched, so it
# neither needs nor disturbs a system Slurm/munge. The node has this machine's CPUs and memory
# (from `slurmd -C`); ProctrackType=proctrack/linuxproc and TaskPlugin=task/none avoid cgroups,
# accounting is off (submitit's sacct calls then fail harmlessly). Needs root (Slurm's daemons and
# munged run as the current user, which must be root for slurmd to launch jobs).
set -euo pipefail

action=${1:-}
dir=${2:-/tmp/harness-slurm}

die() { echo "[slurm_local] $*" >&2; exit 1; }

require_binaries() {
  local missing=()
  for bin in munged slurmctld slurmd sinfo sbatch scontrol; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
  done
  [[ ${#missing[@]} -eq 0 ]] || die "missing ${missing[*]}: install Debian's slurm-wlm and munge (scripts/system_deps.sh)"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

node_field() {  # node_field CPUs|RealMemory: this machine's value as slurmd sees it
  slurmd -C | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n1
}

write_conf() {
  local host ctld_port slurmd_port cpus memory
  host=$(hostname -s)
  ctld_port=$(free_port)
  slurmd_port=$(free_port)
  cpus=$(node_field CPUs)
  memory=$(( $(node_field RealMemory) * 95 / 100 ))  # slurmd drains a node reporting less than RealMemory
  cat >"$dir/slurm.conf" <<EOF
# Written by scripts/slurm_local.sh: one node, no accounting, no cgroups.
ClusterName=harness
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${ctld_port}
SlurmdPort=${slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${dir}/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmdSpoolDir=${dir}/spool
StateSaveLocation=${dir}/state
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd.pid
SlurmctldLogFile=${dir}/log/slurmctld.log
SlurmdLogFile=${dir}/log/slurmd.log
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${memory} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  mkdir -p "$dir/munge"
  chmod 700 "$dir/munge"
  if [[ ! -s "$dir/munge/munge.key" ]]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  fi
  chmod 400 "$dir/munge/munge.key"
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --log-file="$dir/log/munged.log" --pid-file="$dir/munged.pid" --seed-file="$dir/munge/munged.seed"
}

wait_idle() {
  local state=""
  for _ in $(seq 1 120); do
    state=$(SLURM_CONF="$dir/slurm.conf" sinfo -h -N -o '%T' 2>/dev/null | head -n1 || true)
    case "$state" in
      idle|mixed|allocated) return 0 ;;
      down*|drain*|unknown*)
        SLURM_CONF="$dir/slurm.conf" scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node not idle after 60 s (state: ${state:-none}); see $dir/log/slurmctld.log and $dir/log/slurmd.log"
}

start() {
  require_binaries
  [[ $(id -u) -eq 0 ]] || die "needs root (slurmd launches jobs as their user)"
  [[ ! -e "$dir/slurmctld.pid" ]] || die "$dir already holds a cluster; run: $0 stop $dir"
  mkdir -p "$dir/spool" "$dir/state" "$dir/log"
  write_conf
  start_munge
  slurmctld -f "$dir/slurm.conf"
  slurmd -f "$dir/slurm.conf"
  wait_idle
  echo "export SLURM_CONF=$dir/slurm.conf"
}

stop_pid_file() {  # stop_pid_file FILE NAME: kill the pid in FILE if it is still that daemon
  local file=$1 name=$2 pid
  [[ -s "$file" ]] || return 0
  pid=$(tr -dc '0-9' <"$file")
  if [[ -n "$pid" ]] && [[ -r "/proc/$pid/comm" ]] && [[ $(cat "/proc/$pid/comm") == "$name"* ]]; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.25
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

drain() {  # let running jobs finish (up to 20 s), then cancel what is left
  [[ -s "$dir/slurmctld.pid" ]] || return 0
  local jobs
  for _ in $(seq 1 40); do
    jobs=$(SLURM_CONF="$dir/slurm.conf" squeue -h -o '%A' 2>/dev/null || true)
    [[ -z "$jobs" ]] && return 0
    sleep 0.5
  done
  # shellcheck disable=SC2086
  SLURM_CONF="$dir/slurm.conf" scancel $jobs 2>/dev/null || true
  sleep 5
}

cluster_processes() {  # job steps and job processes of this cluster: they carry its SLURM_CONF
  local pid environ variables
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    variables=$({ tr '\0' '\n' <"$environ"; } 2>/dev/null) || continue
    grep -qxF "SLURM_CONF=$dir/slurm.conf" <<<"$variables" || continue
    if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurmstepd ]] || grep -q '^SLURM_JOB_ID=' <<<"$variables"; then
      echo "$pid"
    fi
  done
}

stop() {
  drain
  stop_pid_file "$dir/slurmd.pid" slurmd
  stop_pid_file "$dir/slurmctld.pid" slurmctld
  stop_pid_file "$dir/munged.pid" munged
  local leftovers
  leftovers=$(cluster_processes)
  if [[ -n "$leftovers" ]]; then
    # shellcheck disable=SC2086
    kill -KILL $leftovers 2>/dev/null || true
  fi
}

case "$action" in
  start) start ;;
  stop) stop ;;
  *) die "usage: $0 start|stop [DIR]" ;;
esac
