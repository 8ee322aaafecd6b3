set -eo pipefail  # no -u: conda and module scripts in the setup lines read unset variables

${array_block}# --- stop signals, from the first line on ---
# SLURM sends a preemption, time limit or scancel signal to this script too, never srun's teardown
# of the step after a task failed: the file below tells the ranks which of the two stopped them. A
# signal that comes before srun runs is passed to the ranks, which act on it once they can.
srun_pid=
stopped_by() {
  echo "$$1 $$(date +%s)" >>${run_dir_q}/${batch_signal_file} 2>/dev/null || :
  if [ -n "$$srun_pid" ]; then kill -s "$$1" "$$srun_pid" 2>/dev/null || :; else export HPCGPU_PENDING_SIGNAL="$$1"; fi
}
trap 'stopped_by ${signal}' ${signal}
trap 'stopped_by TERM' TERM

# --- setup (the spec's slurm.setup lines, verbatim) ---
${setup}

# --- environment ---
export PYTHONUNBUFFERED=1
export HPCGPU_JOB_START=$$(date +%s)  # tells a timeout signal from a preemption one
export HPCGPU_RUN_DIR=${run_dir_q}
${env_lines}
# Rendezvous: rank 0 listens on the first host of the allocation, on a port derived from the job id
# (never a fixed 29500, which collides between jobs sharing a node).
MASTER_ADDR=$$(scontrol show hostnames "$$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE under pipefail
export MASTER_ADDR
export MASTER_PORT=${master_port}
export SRUN_CPUS_PER_TASK=$${SLURM_CPUS_PER_TASK:-${cpus}}

# --- launch: ${launch_what} ---
# srun runs in the background so this shell survives the preemption signal and passes it on; the
# ranks checkpoint, rank 0 requeues the job, and the shell returns srun's exit code. --label starts
# every output line with its rank ("1: ..."): `hpcgpu logs JOB --rank 1` shows one rank.
set +e
srun --kill-on-bad-exit=1 --label --ntasks-per-node=${tasks} --cpus-per-task=${cpus} \
  ${rank_command} &
srun_pid=$$!
while :; do
  wait "$$srun_pid"; rc=$$?
  kill -0 "$$srun_pid" 2>/dev/null || break  # wait was cut short by a signal: srun still runs
done
exit "$$rc"
