#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, to run recipes/slurm/*.sbatch for real (tests/test_slurm.py).
#   bash scripts/slurm_local.sh start DIR   # installs munge + slurmctld + slurmd (Debian) when missing,
#                                           # starts the three daemons; prints `export SLURM_CONF=...`
#   SLURM_CONF=DIR/slurm.conf sbatch ...    # submit as on any cluster
#   bash scripts/slurm_local.sh stop DIR    # stops them by the pids they wrote into DIR
# Everything lives in DIR (config, munge key and socket, state, logs, pid files); the ports are free
# ones picked at start, so several clusters (and the system's own daemons, if any) do not meet.
# Needs root (slurmd runs jobs as their user). The node offers CPUS (default 4) CPUs and MEM_MB (8000)
# whatever the machine has (SlurmdParameters=config_overrides): the recipes' tasks share its cores.
set -Eeuo pipefail
cmd=${1:?usage: slurm_local.sh start|stop DIR} dir=${2:?usage: slurm_local.sh start|stop DIR}

stop() {  # the cluster's jobs first (their processes are not the daemons' children), then the daemons
  local name pid pids=() alive=() jobs
  if [ -f "$dir/pids/slurmctld.pid" ] && jobs=$(SLURM_CONF="$dir/slurm.conf" squeue -h -o %A 2>/dev/null) \
     && [ -n "$jobs" ]; then
    # shellcheck disable=SC2086  # one job id a word
    SLURM_CONF="$dir/slurm.conf" scancel $jobs 2>/dev/null || true
    for _ in $(seq 100); do [ -z "$(SLURM_CONF="$dir/slurm.conf" squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
  fi
  # all three at once (TERM), then KILL what is still there after 5 s
  for name in slurmd slurmctld munged; do
    pid=$(cat "$dir/pids/$name.pid" 2>/dev/null) || continue
    kill "$pid" 2>/dev/null && pids+=("$pid")
    rm -f "$dir/pids/$name.pid"
  done
  for _ in $(seq 50); do
    alive=()
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    [ "${#alive[@]}" = 0 ] && return
    sleep 0.1
  done
  kill -9 "${alive[@]}" 2>/dev/null || true
}

install() {  # the three daemons and the client commands, nothing recommended beside them
  command -v munged >/dev/null && command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
    && command -v sbatch >/dev/null && return
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d: the packages' own services stay stopped (this script starts its own daemons)
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends munge slurmctld slurmd slurm-client; }; then
    echo "slurm_local.sh: cannot install munge and Slurm from Debian's packages (apt-get failed)" >&2
    exit 3
  fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
  [ "$(id -u)" = 0 ] || { echo "slurm_local.sh: needs root (slurmd starts jobs as their user)" >&2; exit 1; }
  trap stop ERR
  install
  mkdir -p "$dir"/{munge,state,spool,log,pids}
  mkdir -m 700 -p "$dir/key"
  chmod 755 "$dir" "$dir/munge"  # munged: its socket's directory must be searchable by all
  [ -f "$dir/key/munge.key" ] || { dd if=/dev/urandom of="$dir/key/munge.key" bs=1024 count=1 status=none
                                   chmod 600 "$dir/key/munge.key"; }
  munged --key-file="$dir/key/munge.key" --socket="$dir/munge/socket" --pid-file="$dir/pids/munged.pid" \
         --log-file="$dir/log/munged.log" --seed-file="$dir/key/munged.seed"
  local host ctld_port slurmd_port
  host=$(hostname -s) ctld_port=$(free_port) slurmd_port=$(free_port)
  cat > "$dir/slurm.conf" <<EOF
ClusterName=peagle-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/pids/slurmctld.pid
SlurmdPidFile=$dir/pids/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=${CPUS:-4} RealMemory=${MEM_MB:-8000} State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  slurmctld -f "$dir/slurm.conf"
  slurmd -f "$dir/slurm.conf"
  export SLURM_CONF="$dir/slurm.conf"
  for _ in $(seq 100); do  # up once the node takes jobs
    sinfo -h -o %t 2>/dev/null | grep -qx idle && { echo "export SLURM_CONF=$SLURM_CONF"; return; }
    sleep 0.2
  done
  echo "slurm_local.sh: the node did not come up; see $dir/log/" >&2
  stop
  exit 1
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: slurm_local.sh start|stop DIR" >&2; exit 2 ;;
esac
