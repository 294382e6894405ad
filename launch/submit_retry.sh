# Sourced by launch/ray_submit.sh and launch/slurm/kvrl.sbatch.
# submit_job CMD...: run a `ray job submit` command, retrying while Ray answers "No
# available agent to submit job". The dashboard (and `ray job list`) can be up seconds
# before the head's job agent registers, more so on a loaded machine; such a refused
# submit creates no job, so retrying cannot run the recipe twice.
submit_job() {
  local out rc
  out=$(mktemp)
  for _ in $(seq 60); do
    # `if` keeps `set -e` from exiting on a failed submit; with pipefail, $? is its status
    if "$@" 2>&1 | tee "$out"; then rc=0; else rc=$?; fi
    grep -q "No available agent to submit job" "$out" || { rm -f "$out"; return "$rc"; }
    echo "the Ray job agent is not up yet; retrying in 2 s" >&2
    sleep 2
  done
  rm -f "$out"
  return 1
}
