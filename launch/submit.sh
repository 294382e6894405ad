# Sourced by launch/ray_submit.sh and launch/slurm/kvrl.sbatch (they set PY, AGENT and, for a
# head they started, HEAD_TMP).
#
# job_options ARGS...: the launchers' own options, before RECIPE, into JOB_ARGS (the rest):
#   --py-module DIR     a local package to ship with the job (Ray's runtime_env py_modules):
#                       a user's environments, importable by the driver and every worker
#   --env-var KEY=VALUE an environment variable for the driver and every worker
#   --runtime-env FILE  a YAML runtime env merged over launch/runtime_env.yaml
# runtime_env FILE: write the merged runtime env there (what `ray job submit --runtime-env` reads).
# ports_free PORT:VAR ...: refuse, naming the variable to change, a port another process holds.
# submit_job CMD...: run a `ray job submit` command, retrying while Ray answers "No available
#   agent to submit job" (the dashboard is up seconds before the head's job agent registers,
#   more so on a loaded machine; a refused submit creates no job, so a retry cannot run the
#   recipe twice); after KVRL_AGENT_WAIT_S (30) it stops and says why the agent is not up.
job_options() {
  PY_MODULES=() ENV_VARS=() USER_RUNTIME_ENV=""
  while [[ $# -gt 0 && $1 == --* ]]; do
    case $1 in
      --py-module) [ -d "${2:-}" ] || { echo "--py-module ${2:-}: no such folder" >&2; exit 2; }
                   PY_MODULES+=("$(cd "$2" && pwd)"); shift 2 ;;
      --env-var) [[ ${2:-} == *=* ]] || { echo "--env-var takes KEY=VALUE (got '${2:-}')" >&2; exit 2; }
                 ENV_VARS+=("$2"); shift 2 ;;
      --runtime-env) [ -f "${2:-}" ] || { echo "--runtime-env ${2:-}: no such file" >&2; exit 2; }
                     USER_RUNTIME_ENV=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
      *) echo "unknown option $1: the options are --py-module DIR, --env-var KEY=VALUE, --runtime-env FILE" >&2
         exit 2 ;;
    esac
  done
  JOB_ARGS=("$@")
}

runtime_env() {
  "$PY" - "$1" "$USER_RUNTIME_ENV" "${#PY_MODULES[@]}" "${PY_MODULES[@]}" "${ENV_VARS[@]}" <<'PYEOF'
import sys, yaml
out, user, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
modules, env_vars = sys.argv[4:4 + n], sys.argv[4 + n:]
env = yaml.safe_load(open("launch/runtime_env.yaml"))
for key, value in ((yaml.safe_load(open(user)) or {}) if user else {}).items():
    env[key] = {**env.get(key, {}), **value} if key == "env_vars" else value
if modules:  # an empty py_modules list makes Ray's runtime-env agent fail the job
    env["py_modules"] = [*env.get("py_modules", []), *modules]
env["env_vars"] = {**env.get("env_vars", {}), **dict(kv.split("=", 1) for kv in env_vars)}
yaml.safe_dump(env, open(out, "w"), sort_keys=False)
PYEOF
}

ports_free() {
  local spec port var
  for spec in "$@"; do
    port=${spec%%:*} var=${spec#*:}
    if ! "$PY" -c "import socket,sys; s=socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1])))" "$port" 2>/dev/null; then
      echo "port $port ($var) is held by another process, another Ray on this machine perhaps" \
           "(\`ss -ltnp | grep :$port\` names it); a head started here could not serve it: set $var=<a free port>" >&2
      exit 1
    fi
  done
}

why_no_agent() {
  echo "the Ray job agent did not register within ${KVRL_AGENT_WAIT_S:-30} s, so the job cannot be submitted." >&2
  local log
  log=$(grep -ls "already in use" "${HEAD_TMP:-/nonexistent}"/session_latest/logs/dashboard_agent*.{log,err,out} \
        2>/dev/null | head -n 1 || true)
  if [ -n "$log" ]; then
    echo "Cause: the head's agent could not bind its port ($log):" >&2
    grep -m 1 "already in use" "$log" >&2
    echo "Fix: set RAY_DASHBOARD_AGENT_PORT to a free port (now $AGENT)." >&2
  else
    echo "Likely causes: another process holds the agent's port $AGENT (\`ss -ltnp | grep :$AGENT\`; set" \
         "RAY_DASHBOARD_AGENT_PORT); the head runs another RAY_AUTH_MODE than this client's ($RAY_AUTH_MODE); or" \
         "a loaded machine (KVRL_AGENT_WAIT_S=120 waits longer). The head's logs: its session_latest/logs." >&2
  fi
}

submit_job() {
  local out rc tries
  out=$(mktemp)
  tries=$(( (${KVRL_AGENT_WAIT_S:-30} + 1) / 2 ))
  for _ in $(seq "$tries"); do
    # `if` keeps `set -e` from exiting on a failed submit; with pipefail, $? is its status
    if "$@" 2>&1 | tee "$out"; then rc=0; else rc=$?; fi
    grep -q "No available agent to submit job" "$out" || { rm -f "$out"; return "$rc"; }
    echo "the Ray job agent is not up yet; retrying in 2 s" >&2
    sleep 2
  done
  rm -f "$out"
  why_no_agent
  return 1
}
