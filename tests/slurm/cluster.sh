#!/usr/bin/env bash
# Bring up / tear down a real, local, two-node SLURM cluster for the test suite.
#
#   tests/slurm/cluster.sh start|stop|status
#
# Layout: everything lives under one run folder, ${HPCGPU_SLURM_DIR:-/tmp/hpcgpu-slurm}:
#   etc/  slurm.conf gres.conf cgroup.conf (copied to /etc/slurm/ so that plain
#         sbatch/squeue/scontrol/scancel find them without SLURM_CONF)
#   dev/  fake GPU character devices nvidia0..3 (major 195, like the real driver)
#   state/ slurmctld StateSaveLocation (wiped on every start: no old jobs reappear)
#   spool/<node>/ slurmd spool dirs, log/ daemon logs + jobcomp.txt, run/ pid files
#
# Nodes n1 and n2 are two slurmd processes on this host (ports 6821/6822), each
# advertising 8 CPUs and 4 GPUs (SlurmdParameters=config_overrides lets them claim
# more than the real cores). Partition "gpu" (default) = n1,n2; "debug" = n1.
#
# Authentication: munge is used when it works (an already-running munged is reused;
# otherwise we start one as user munge and remember its pid so stop can end it).
# If munge cannot be made to work, we fall back to AuthType=auth/none +
# CredType=cred/none, which Slurm 22.05 still accepts for a single-host cluster.
#
# Daemons are stopped only through their own pid files, never by name.
set -euo pipefail

DIR="${HPCGPU_SLURM_DIR:-/tmp/hpcgpu-slurm}"
NODES=(n1 n2)
HOST="$(hostname -s)"
ETC_SLURM=/etc/slurm
MUNGE_PID=/run/munge/munged.pid
MUNGE_MARK="$DIR/run/munged.started"   # present => we started munged (holds its pid)
WAIT_S="${HPCGPU_SLURM_WAIT:-60}"

log() { echo "[cluster.sh $(date +%T)] $*" >&2; }

ctld_pidfile() { echo "$DIR/run/slurmctld.pid"; }
slurmd_pidfile() { echo "$DIR/run/slurmd-$1.pid"; }

pid_alive() {  # pidfile -> prints pid and succeeds if that process is alive
    local f="$1" pid
    [[ -s "$f" ]] || return 1
    pid="$(tr -dc '0-9' <"$f")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
    # a killed daemon may linger as a zombie until init reaps it
    [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] || return 1
    echo "$pid"
}

ensure_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    log "installing slurm + munge packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
}

add_hosts() {  # so n1/n2 (e.g. MASTER_ADDR from SLURM_NODELIST) resolve
    local n
    for n in "${NODES[@]}"; do
        grep -Eq "^[[:space:]]*127\.0\.0\.1([[:space:]].*)?[[:space:]]$n([[:space:]]|\$)" /etc/hosts \
            || echo "127.0.0.1 $n" >>/etc/hosts
    done
}

make_gpus() {
    mkdir -p "$DIR/dev"
    local i
    for i in 0 1 2 3; do
        local f="$DIR/dev/nvidia$i"
        [[ -c "$f" ]] && continue
        rm -f "$f"
        # Character devices as a real driver would create; slurmd only stat()s
        # them. If mknod is not permitted, a regular file also satisfies slurmd.
        mknod "$f" c 195 "$i" 2>/dev/null || : >"$f"
    done
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {  # -> sets AUTH to munge or none
    AUTH=none
    command -v munged >/dev/null || { log "munged not installed; using auth/none"; return 0; }
    if munge_works; then AUTH=munge; return 0; fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key --force
        elif command -v create-munge-key >/dev/null; then
            create-munge-key -f
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
        fi
        chown munge:munge /etc/munge/munge.key 2>/dev/null || true
        chmod 400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    # a dead munged may leave its socket/pid behind; munged refuses to start then
    if ! pid_alive "$MUNGE_PID" >/dev/null; then
        rm -f "$MUNGE_PID" /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    fi
    if runuser -u munge -- /usr/sbin/munged --force 2>"$DIR/log/munged.err"; then
        local t
        for t in $(seq 50); do munge_works && break; sleep 0.1; done
    fi
    # remember that we started it, so that stop ends it (even if unusable)
    pid_alive "$MUNGE_PID" >"$MUNGE_MARK" || rm -f "$MUNGE_MARK"
    if munge_works; then
        AUTH=munge
    else
        log "munge does not work (see $DIR/log/munged.err); using auth/none"
    fi
}

write_config() {
    local auth_lines
    if [[ "$AUTH" == munge ]]; then
        auth_lines=$'AuthType=auth/munge\nCredType=cred/munge'
    else
        auth_lines=$'AuthType=auth/none\nCredType=cred/none'
    fi
    mkdir -p "$DIR/etc"
    cat >"$DIR/etc/slurm.conf" <<EOF
# generated by tests/slurm/cluster.sh -- local test cluster, run dir $DIR
ClusterName=hpcgpu
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
$auth_lines
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
MailProg=/bin/true
MinJobAge=3600
SchedulerParameters=sched_interval=2,bf_interval=1
ReturnToService=2
JobRequeue=1
PreemptMode=OFF
KillWait=30
# Small, so that the tests can submit a sweep larger than it with a handful of tasks (array
# indices 0-3: a 5-point sweep splits into two arrays); SLURM's default is 1001.
MaxArraySize=4
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=6821 CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=16000 Gres=gpu:4 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=6822 CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=16000 Gres=gpu:4 State=UNKNOWN
PartitionName=gpu Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
PartitionName=debug Nodes=n1 MaxTime=INFINITE State=UP
EOF
    cat >"$DIR/etc/gres.conf" <<EOF
AutoDetect=off
NodeName=n[1-2] Name=gpu File=$DIR/dev/nvidia[0-3]
EOF
    cat >"$DIR/etc/cgroup.conf" <<EOF
CgroupPlugin=autodetect
IgnoreSystemd=yes
EOF
    # Client commands (sbatch, squeue, ...) run without SLURM_CONF in the tests,
    # so they must find the config in the default place: copy it there.
    mkdir -p "$ETC_SLURM"
    cp -f "$DIR/etc/slurm.conf" "$DIR/etc/gres.conf" "$DIR/etc/cgroup.conf" "$ETC_SLURM/"
}

print_logs() {
    local f
    for f in "$DIR/log/slurmctld.log" "$DIR"/log/slurmd-*.log "$DIR/log/"*.err; do
        [[ -s "$f" ]] || continue
        echo "===== tail $f" >&2
        tail -n 30 "$f" >&2
    done
}

node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }

wait_idle() {  # seconds
    local deadline=$((SECONDS + $1)) states
    while ((SECONDS < deadline)); do
        states="$(node_states)"
        if [[ "$(grep -Ec '^n[12] idle$' <<<"$states")" == 2 ]]; then return 0; fi
        sleep 0.5
    done
    return 1
}

running_pids() {  # prints pids of our live slurm daemons
    local n
    pid_alive "$(ctld_pidfile)" || true
    for n in "${NODES[@]}"; do pid_alive "$(slurmd_pidfile "$n")" || true; done
}

all_running() {
    local n
    pid_alive "$(ctld_pidfile)" >/dev/null || return 1
    for n in "${NODES[@]}"; do pid_alive "$(slurmd_pidfile "$n")" >/dev/null || return 1; done
}

kill_and_wait() {  # pid... : TERM, wait up to 15 s, then KILL
    local pids=("$@") p t alive
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for t in $(seq 150); do
        alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        ((alive)) || return 0
        sleep 0.1
    done
    log "forcing kill of ${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null || true
    sleep 0.2
}

step_pids() {  # slurmstepd processes serving our nodes (their cwd is under $DIR)
    local p
    for p in /proc/[0-9]*; do
        [[ "$(readlink "$p/exe" 2>/dev/null)" == */slurmstepd* ]] || continue  # Debian: slurmstepd-wlm
        [[ "$(readlink "$p/cwd" 2>/dev/null)" == "$DIR"/* ]] && echo "${p#/proc/}"
    done
    return 0
}

with_descendants() {  # pid... -> those pids plus all their descendants
    local -A kids=()
    local stat pid ppid rest
    for stat in /proc/[0-9]*/stat; do
        read -r pid _ rest <"$stat" 2>/dev/null || continue
        rest="${rest##*) }"            # drop "(comm)" which may contain spaces
        ppid="$(cut -d' ' -f2 <<<"$rest")"
        kids[$ppid]+="$pid "
    done
    local queue=("$@") out=()
    while ((${#queue[@]})); do
        pid="${queue[0]}"; queue=("${queue[@]:1}")
        out+=("$pid")
        # shellcheck disable=SC2206
        queue+=(${kids[$pid]:-})
    done
    printf '%s\n' "${out[@]}"
}

do_stop() {
    local pids dpids n t
    # Cancel jobs first so job processes do not outlive the cluster. Jobs whose
    # processes ignore SIGTERM would take KillWait (30 s) to finish, so we only
    # wait a little and then kill what is left of the job trees below.
    if pid_alive "$(ctld_pidfile)" >/dev/null; then
        local jobs
        jobs="$(squeue -h -t R,CG,PD,S,CF -o %A 2>/dev/null | tr '\n' ' ' || true)"
        if [[ -n "${jobs// /}" ]]; then
            # shellcheck disable=SC2086
            scancel --signal=KILL --full $jobs 2>/dev/null || true
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for t in $(seq 10); do
                [[ -z "$(squeue -h -t R,CG -o %A 2>/dev/null)" ]] && break
                sleep 0.2
            done
        fi
    fi
    # leftover slurmstepd + job processes (e.g. ignoring SIGTERM during KillWait):
    # kill them before the daemons, which otherwise wait for them.
    mapfile -t pids < <(step_pids)
    ((${#pids[@]})) && mapfile -t pids < <(with_descendants "${pids[@]}")
    if ((${#pids[@]})); then
        log "killing leftover job processes: ${pids[*]}"
        kill -KILL "${pids[@]}" 2>/dev/null || true
        sleep 0.2
    fi
    log "stopping slurmd"
    # slurmds first (they may still report job completion to slurmctld)
    mapfile -t dpids < <(for n in "${NODES[@]}"; do pid_alive "$(slurmd_pidfile "$n")" || true; done)
    kill_and_wait "${dpids[@]}"
    log "stopping slurmctld"
    mapfile -t dpids < <(pid_alive "$(ctld_pidfile)" || true)
    kill_and_wait "${dpids[@]}"
    if [[ -f "$MUNGE_MARK" ]]; then
        mapfile -t dpids < <(pid_alive "$MUNGE_PID" || true)
        kill_and_wait "${dpids[@]}"
        rm -f "$MUNGE_MARK"
    fi
    rm -f "$DIR"/run/*.pid
}

do_start() {
    ensure_packages
    if all_running; then
        log "cluster already running (pids $(running_pids | tr '\n' ' '))"
        # a cluster started by an older version of this script: bring its config up to date
        AUTH="$(sed -n 's|^AuthType=auth/||p' "$DIR/etc/slurm.conf" 2>/dev/null)"
        AUTH="${AUTH:-none}"
        local old dpids
        old="$(cat "$DIR/etc/slurm.conf" 2>/dev/null || true)"
        write_config
        if [[ "$(cat "$DIR/etc/slurm.conf")" != "$old" ]]; then
            # a restart, not `scontrol reconfigure`: slurmctld 22.05 keeps some values (MaxArraySize)
            # until it restarts; its saved state keeps the jobs, and slurmd keeps running them
            log "slurm.conf changed since the cluster started: restarting slurmctld"
            mapfile -t dpids < <(pid_alive "$(ctld_pidfile)" || true)
            kill_and_wait "${dpids[@]}"
            slurmctld -i -f "$DIR/etc/slurm.conf" 2>>"$DIR/log/slurmctld.err" || { print_logs; exit 1; }
            local t
            for t in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
            for t in $(seq $((WAIT_S * 2))); do  # both nodes up again (they may be running jobs)
                [[ "$(node_states | grep -Ec '^n[12] (idle|mixed|allocated)$')" == 2 ]] && break
                sleep 0.5
            done
            log "slurmctld back: $(node_states | tr '\n' ' ')"
        fi
        return 0
    fi
    if [[ -n "$(running_pids)" || -f "$MUNGE_MARK" ]]; then
        log "stale/partial cluster found; stopping it first"
        do_stop
    fi
    rm -rf "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
    mkdir -p "$DIR/state" "$DIR/log" "$DIR/run"
    local n
    for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
    add_hosts
    make_gpus
    start_munge
    write_config
    log "starting slurmctld (auth/$AUTH, dir $DIR)"
    slurmctld -i -f "$DIR/etc/slurm.conf" 2>>"$DIR/log/slurmctld.err" || { print_logs; exit 1; }
    local t
    for t in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
    for n in "${NODES[@]}"; do
        slurmd -N "$n" -f "$DIR/etc/slurm.conf" 2>>"$DIR/log/slurmd-$n.err" || { print_logs; exit 1; }
    done
    if ! wait_idle 20; then
        log "nodes not idle yet: $(node_states | tr '\n' ';'); resuming"
        scontrol update nodename=n1,n2 state=resume 2>/dev/null || true
        if ! wait_idle "$WAIT_S"; then
            log "cluster failed to come up: $(node_states | tr '\n' ';')"
            print_logs
            exit 1
        fi
    fi
    log "cluster up: $(node_states | tr '\n' ' ')"
}

do_status() {
    local n p rc=0
    if p="$(pid_alive "$(ctld_pidfile)")"; then echo "slurmctld: running (pid $p)"; else echo "slurmctld: not running"; rc=1; fi
    for n in "${NODES[@]}"; do
        if p="$(pid_alive "$(slurmd_pidfile "$n")")"; then echo "slurmd $n: running (pid $p)"; else echo "slurmd $n: not running"; rc=1; fi
    done
    if p="$(pid_alive "$MUNGE_PID")"; then
        echo "munged: running (pid $p$([[ -f "$MUNGE_MARK" ]] && echo ', started by cluster.sh'))"
    else
        echo "munged: not running"
    fi
    echo "config: $DIR/etc/slurm.conf (copied to $ETC_SLURM/slurm.conf)"
    if ((rc == 0)); then sinfo || rc=1; fi
    return "$rc"
}

case "${1:-}" in
    start) do_start ;;
    stop) do_stop; log "stopped" ;;
    status) do_status ;;
    restart) do_stop; do_start ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
