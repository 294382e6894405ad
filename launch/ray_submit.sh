#!/usr/bin/env bash
# Run a recipe as a Ray job:  launch/ray_submit.sh [OPTIONS] RECIPE [key=value ...]
#
#   ray job submit --runtime-env <launch/runtime_env.yaml + OPTIONS> -- .venv/bin/python -m kvrl.run recipe=RECIPE ...
#
# OPTIONS (launch/submit.sh): --py-module DIR ships a local package with the job (a user's
# environments: `--py-module ../kvtasks env.id=kvtasks/partial-counts-v0`), --env-var KEY=VALUE
# sets a variable for the driver and every worker, --runtime-env FILE merges a YAML runtime env.
#
# against the Ray head at 127.0.0.1:$RAY_PORT. If none is running, one is started here
# (`ray start --head --block`, in its own process group) and stopped when the job ends;
# KVRL_KEEP_HEAD=1 leaves it running. `ray stop` is never used: it stops every Ray
# cluster on the machine, other users' included.
#
# A head started here refuses at once a port another process holds, naming the variable to change;
# a job agent that does not register within KVRL_AGENT_WAIT_S (30) s is diagnosed (launch/submit.sh).
# Environment: KVRL_PYTHON (default .venv/bin/python), RAY_PORT (6379), RAY_DASHBOARD_PORT
# (8265, where the job server listens), RAY_DASHBOARD_AGENT_PORT (52365, the node's job agent:
# a head whose agent cannot bind it accepts a job and never runs it), RAY_NUM_CPUS (all), RAY_AUTH_MODE (token; use the
# running head's mode), RAY_AUTH_TOKEN (default: ~/.ray/auth_token, created if missing;
# a head started with another token needs that one), DRY_RUN=1 prints the commands only.
# Outputs go to outputs/<run_name> in this checkout (output_dir is passed as an absolute
# path: the job itself runs in a copy of the working_dir that Ray unpacks elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/submit.sh
job_options "$@"
set -- "${JOB_ARGS[@]}"
RECIPE=${1:?usage: launch/ray_submit.sh [--py-module DIR] [--env-var KEY=VALUE] [--runtime-env FILE] RECIPE [key=value ...]}
shift
PY=${KVRL_PYTHON:-$PWD/.venv/bin/python}
RAY="$(dirname "$PY")/ray"
PORT=${RAY_PORT:-6379}
DASH=${RAY_DASHBOARD_PORT:-8265}
AGENT=${RAY_DASHBOARD_AGENT_PORT:-52365}
LOG=${TMPDIR:-/tmp}/kvrl_ray_head_$PORT.log
HEAD_TMP=${TMPDIR:-/tmp}/kvrl_ray_$PORT  # a head started here keeps its logs apart from other Rays'

# Token auth: Ray 2.60 turns it on for new clusters, and a client
# whose RAY_AUTH_MODE differs from the cluster's fails with "AuthenticationError: Missing
# authentication token". So the head and the client get the same mode and the same token.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${DRY_RUN:-}" ]; then
  RAY_AUTH_TOKEN="$("$RAY" get-auth-token --generate 2>/dev/null | tail -n 1)"
  export RAY_AUTH_TOKEN
fi

head_cmd=("$RAY" start --head --block --port "$PORT" --dashboard-port "$DASH" --include-dashboard true
          --dashboard-agent-listen-port "$AGENT" --temp-dir "$HEAD_TMP" --disable-usage-stats
          ${RAY_NUM_CPUS:+--num-cpus "$RAY_NUM_CPUS"})
ENV_FILE=$(mktemp --suffix .yaml)
trap 'rm -f "$ENV_FILE"' EXIT
runtime_env "$ENV_FILE"
submit_cmd=("$RAY" job submit --address "http://127.0.0.1:$DASH" --runtime-env "$ENV_FILE"
            -- "$PY" -m kvrl.run "recipe=$RECIPE" "output_dir=$PWD/outputs/\${run_name}" "$@")

if [ -n "${DRY_RUN:-}" ]; then
  echo "head:   ${head_cmd[*]}"
  echo "submit: ${submit_cmd[*]}"
  sed 's/^/env:    /' "$ENV_FILE"
  exit 0
fi

head_up() { "$RAY" job list --address "http://127.0.0.1:$DASH" >/dev/null 2>&1; }
if ! head_up; then
  ports_free "$PORT:RAY_PORT" "$DASH:RAY_DASHBOARD_PORT" "$AGENT:RAY_DASHBOARD_AGENT_PORT"
  setsid "${head_cmd[@]}" >"$LOG" 2>&1 &
  head_pgid=$!
  stop_head() {
    kill -TERM -- "-$head_pgid" 2>/dev/null || return 0
    for _ in $(seq 20); do kill -0 -- "-$head_pgid" 2>/dev/null || return 0; sleep 0.5; done
    kill -KILL -- "-$head_pgid" 2>/dev/null || true
  }
  [ -n "${KVRL_KEEP_HEAD:-}" ] || trap 'stop_head; rm -f "$ENV_FILE"' EXIT
  for _ in $(seq 120); do head_up && break; sleep 1; done
  head_up || { echo "the Ray head did not come up within 120 s; see $LOG" >&2; exit 1; }
fi
submit_job "${submit_cmd[@]}"
