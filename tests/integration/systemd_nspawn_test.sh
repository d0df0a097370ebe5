#!/usr/bin/env bash
# The units under a real systemd (Debian 12's 252), booted in a container: debootstrap makes a
# minimal tree once (cached), systemd-nspawn boots a copy with the built binaries, our units and a
# small random-weight model installed, and nsenter drives systemctl inside. Then, for real:
#   - the worker's READY=1 comes only after its model is loaded, its canary matched a record and
#     it listens; the broker's only after its own canary check;
#   - SIGKILL of the worker mid-generation: systemd restarts it, the broker re-attaches, and the
#     generation completes identical to a fault-free run;
#   - SIGSTOP of the worker mid-generation: its watchdog fires, systemd restarts it, same outcome;
#   - a worker that cannot start hits its StartLimit, and the broker reports NOT_SERVING.
# Needs root, debootstrap, systemd-nspawn (systemd-container) and nsenter (tools/setup.sh installs
# them). Usage: systemd_nspawn_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
bin=$(cd "$1" && pwd) src=$(cd "$2" && pwd)
if [ "$(id -u)" != 0 ]; then  # systemd-nspawn needs root: as setup.sh, through sudo
  exec sudo -n "$0" "$bin" "$src" || { echo "FAIL: needs root or sudo (systemd-nspawn)"; exit 1; }
fi
for tool in debootstrap systemd-nspawn nsenter curl; do
  command -v "$tool" > /dev/null || { echo "FAIL: $tool not found (run tools/setup.sh)"; exit 1; }
done

log() { echo "[$(date +%T)] $*"; }
fail() { echo "FAIL: $*"; exit 1; }
# Polls `cmd` until it succeeds or `seconds` pass (bounded waits, no fixed sleeps).
waitFor() {
  local seconds=$1
  shift
  local until=$((SECONDS + seconds))
  while ! "$@" > /dev/null 2>&1; do
    [ $SECONDS -lt $until ] || return 1
    sleep 0.1
  done
}

# The base tree, made once: Debian's mirror as this machine's apt sources name it.
cache=${BULKHEAD_NSPAWN_CACHE:-/var/cache/bulkhead-nspawn}/bookworm
if [ ! -x "$cache/usr/lib/systemd/systemd" ]; then
  mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2> /dev/null ||
    true)
  [ -n "$mirror" ] || mirror=$(awk '/^deb / { print $2; exit }' /etc/apt/sources.list 2> /dev/null ||
    true)
  mirror=${mirror:-http://deb.debian.org/debian}
  log "debootstrap bookworm from $mirror into $cache"
  rm -rf "$cache.tmp"
  mkdir -p "$(dirname "$cache")"
  debootstrap --variant=minbase --include=systemd,dbus bookworm "$cache.tmp" "$mirror" \
    > "$(dirname "$cache")/debootstrap.log" 2>&1 || fail "debootstrap (see $(dirname "$cache")/debootstrap.log)"
  mv "$cache.tmp" "$cache"
fi

work=$(mktemp -d /var/tmp/bulkhead-nspawn.XXXXXX)
root=$work/root
nspawn_pid=
cleanup() {
  if [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2> /dev/null; then
    kill -TERM "$nspawn_pid" 2> /dev/null || true
    waitFor 20 bash -c "! kill -0 $nspawn_pid" || kill -KILL "$nspawn_pid" 2> /dev/null || true
  fi
  # What nspawn leaves behind with --keep-unit --register=no: the container's empty cgroups
  # ("payload" under each hierarchy this one runs in) and its empty state directories.
  for payload in /sys/fs/cgroup/payload /sys/fs/cgroup/*/payload; do
    [ -d "$payload" ] && find "$payload" -depth -type d -exec rmdir {} \; 2> /dev/null
  done
  rmdir /run/systemd/nspawn/locks /run/systemd/nspawn/propagate /run/systemd/nspawn \
    2> /dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
cp -a "$cache" "$root"

# Install: binaries, the libraries the tree lacks, units, users and directories, a model.
install -m 755 "$bin/bulkhead-broker" "$bin/bulkhead-worker" "$root/usr/local/bin/"
mkdir -p "$root/usr/local/lib/bulkhead"
binds=()
# ldd's output held first: `ldd | grep -q` under pipefail fails whenever grep stops reading early.
libs=$(ldd "$bin/bulkhead-broker" "$bin/bulkhead-worker" | awk '/=> \// { print $3 }' | sort -u)
for lib in $libs; do
  case $lib in
    /usr/local/cuda*) ;;  # bound read-only below, not copied
    *) [ -e "$root$lib" ] || cp -L "$lib" "$root/usr/local/lib/bulkhead/" ;;
  esac
done
echo /usr/local/lib/bulkhead > "$root/etc/ld.so.conf.d/bulkhead.conf"
cuda_libs=$(grep '^/usr/local/cuda' <<< "$libs" || true)
if [ -n "$cuda_libs" ]; then
  binds+=(--bind-ro=/usr/local/cuda)
  xargs -n1 dirname <<< "$cuda_libs" | sort -u >> "$root/etc/ld.so.conf.d/bulkhead.conf"
fi
chroot "$root" ldconfig 2> /dev/null || true
for unit in "$src"/systemd/*.service "$src"/systemd/*.target; do
  install -m 644 "$unit" "$root/etc/systemd/system/"
done
install -D -m 644 "$src/systemd/bulkhead.sysusers" "$root/usr/lib/sysusers.d/bulkhead.conf"
install -D -m 644 "$src/systemd/bulkhead.tmpfiles" "$root/usr/lib/tmpfiles.d/bulkhead.conf"
"$bin/bulkhead" make-model --shape tiny-v152k --out "$root/var/lib/bulkhead/model" --seed 3 > /dev/null
chmod -R a+rX "$root/var/lib/bulkhead/model"
# The worker's canary record, qualified here (the model is the same bytes in the container).
"$bin/bulkhead" qualify --model "$root/var/lib/bulkhead/model" --backend cpu \
  --out "$root/etc/bulkhead-canary.json" > /dev/null 2>&1 || fail "bulkhead qualify"
chmod a+r "$root/etc/bulkhead-canary.json"

# Port 0 for gRPC and metrics (the container shares this host's network): the broker's status
# line and log say which ports it bound.
cat > "$root/etc/default/bulkhead" << EOF
BULKHEAD_MODEL=/var/lib/bulkhead/model
BULKHEAD_BACKEND=cpu
BULKHEAD_LISTEN=127.0.0.1:0
BULKHEAD_WORKER_ARGS=--canary-record /etc/bulkhead-canary.json
EOF
# The broker attaches to worker 0. Its step deadline is longer than the worker's watchdog, so a
# stopped worker is caught by the watchdog, not by the broker.
mkdir -p "$root/etc/systemd/system/bulkhead-broker.service.d" \
  "$root/etc/systemd/system/bulkhead-worker@.service.d"
cat > "$root/etc/systemd/system/bulkhead-broker.service.d/test.conf" << EOF
[Unit]
Wants=bulkhead-worker@0.service
After=bulkhead-worker@0.service
[Service]
ExecStart=
ExecStart=/usr/local/bin/bulkhead-broker --model \${BULKHEAD_MODEL} --listen \${BULKHEAD_LISTEN} \
  --backend cpu --workers-from /run/bulkhead/worker-0.sock --attach-timeout-s 3 \
  --step-timeout-ms 30000 --heartbeat-ms 30000 --metrics-listen 127.0.0.1:0
EOF
cat > "$root/etc/systemd/system/bulkhead-worker@.service.d/test.conf" << EOF
[Service]
WatchdogSec=3
EOF

log "booting systemd in $root"
systemd-nspawn -D "$root" -b --register=no --keep-unit -q "${binds[@]}" > "$work/console.log" 2>&1 &
nspawn_pid=$!
leader=
findLeader() { leader=$(pgrep -P "$nspawn_pid" | head -1) && [ -n "$leader" ]; }
waitFor 30 findLeader || { cat "$work/console.log"; fail "the container did not start"; }
findLeader
ctl() { nsenter -t "$leader" -m -u -i -p -r -w -- "$@"; }
booted() { [[ $(ctl systemctl is-system-running 2> /dev/null) =~ ^(running|degraded)$ ]]; }
waitFor 60 booted || { ctl systemctl --failed || true; fail "systemd did not finish booting"; }
log "booted: $(ctl systemctl --version | head -1)"

# 1. READY=1 only after load (worker) and after the canary (broker): systemd logs "Started" when
# READY arrives, after the process's own lines.
ctl systemctl start bulkhead-worker@0 || { ctl journalctl -u bulkhead-worker@0 --no-pager | tail -20; fail "worker start"; }
ctl systemctl start bulkhead-broker || { ctl journalctl -u bulkhead-broker --no-pager | tail -20; fail "broker start"; }
journal=$(ctl journalctl --no-pager -o cat -u bulkhead-worker@0 -u bulkhead-broker)
order() {  # the first line matching $1 comes before the first matching $2
  local a b
  a=$(grep -n -m1 -- "$1" <<< "$journal" | cut -d: -f1)
  b=$(grep -n -m1 -- "$2" <<< "$journal" | cut -d: -f1)
  [ -n "$a" ] && [ -n "$b" ] && [ "$a" -lt "$b" ]
}
order "canary passed" "Started bulkhead-worker@0.service" ||
  fail "the worker was reported started before its canary passed"
order "serving on /run/bulkhead/worker-0.sock" "Started bulkhead-worker@0.service" ||
  fail "the worker was reported started before it loaded and listened"
order "canary qualified" "Started bulkhead-broker.service" ||
  fail "the broker was reported started before its canary"
status=$(ctl systemctl show -p StatusText --value bulkhead-broker)
[[ $status =~ ^"serving on 127.0.0.1:"([0-9]+)$ ]] || fail "broker status: $status"
port=${BASH_REMATCH[1]}
metrics_port=$(grep -o -m1 'metrics at http://127.0.0.1:[0-9]*' <<< "$journal" | grep -o '[0-9]*$')
[ -n "$metrics_port" ] || fail "the broker logged no metrics address"
log "READY after load and canary"

generate() {
  "$bin/bulkhead" generate --server "127.0.0.1:$port" --tokens 1,2,3 --max-tokens 900 \
    --ignore-eos
}
reference=$(generate 2> /dev/null) || fail "fault-free generation"
[ "$(tr -cd , <<< "$reference" | wc -c)" -eq 899 ] || fail "fault-free generation: $reference"
metric() {
  curl -sf "http://127.0.0.1:$metrics_port/metrics" | awk -v name="$1" '$1 ~ "^"name"({|$)" { s += $2 } END { print s + 0 }'
}
generating() { [ "$(metric bulkhead_generated_tokens_total)" -gt "$1" ]; }

# 2 and 3: a fault in the middle of a generation, then the same tokens.
# The worker's process id as this host sees it (the container has its own pid namespace): the
# signal goes straight to it, without the second a `systemctl kill` inside can take.
# A stopped one (an earlier SIGSTOP that its watchdog has not yet ended) does not count.
workerPid() {
  local p state
  for p in $(pgrep -f /usr/local/bin/bulkhead-worker); do
    [ "$(readlink "/proc/$p/ns/pid")" = "$(readlink "/proc/$leader/ns/pid")" ] || continue
    state=$(awk '{ print $3 }' "/proc/$p/stat" 2> /dev/null) || continue
    case $state in R | S | D) echo "$p" && return ;; esac
  done
  return 1
}
midGeneration() {
  local signal=$1 attempt before replayed_before client landed pid
  for attempt in 1 2 3; do
    waitFor 30 workerPid || fail "no running worker process before $signal"
    pid=$(workerPid)
    before=$(metric bulkhead_generated_tokens_total)
    replayed_before=$(metric bulkhead_replayed_sequences_total)
    generate > "$work/out" 2> "$work/err" &
    client=$!
    # Early in the 900 tokens: on a loaded host the signal can take a second to land.
    waitFor 20 generating $((before + 20)) || fail "no tokens before $signal"
    # A signal sent once the generation had ended (or to a worker already gone) tested nothing:
    # that attempt does not count.
    landed=1
    kill -s "$signal" "$pid" 2> /dev/null || landed=0
    { kill -0 "$client" 2> /dev/null && ! generating $((before + 899)); } || landed=0
    wait "$client" || { cat "$work/err"; fail "the generation failed after $signal"; }
    [ "$(cat "$work/out")" = "$reference" ] || fail "tokens after $signal differ from the fault-free run"
    if [ "$landed" = 0 ]; then
      log "$signal did not land mid-generation (attempt $attempt); again"
      continue
    fi
    [ "$(metric bulkhead_replayed_sequences_total)" -gt "$replayed_before" ] ||
      fail "nothing was replayed after $signal"
    return 0
  done
  fail "$signal never landed mid-generation in 3 attempts"
}
restarts() { ctl systemctl show -p NRestarts --value bulkhead-worker@0; }
r0=$(restarts)
midGeneration SIGKILL
[ "$(restarts)" -gt "$r0" ] || fail "systemd did not restart the killed worker"
log "SIGKILL mid-generation: restarted, re-attached, identical tokens"

r0=$(restarts)
midGeneration SIGSTOP
[ "$(restarts)" -gt "$r0" ] || fail "systemd did not restart the stopped worker"
grep -q "Watchdog timeout" <<< "$(ctl journalctl --no-pager -u bulkhead-worker@0)" ||
  fail "the worker's watchdog did not fire"
log "SIGSTOP mid-generation: watchdog fired, restarted, identical tokens"

# Structured journal fields: the worker's entries and the broker's name the same incarnations,
# one per worker the broker served with; a request that ends badly is found by its id.
fieldValues() {  # unit field: the distinct values of a field in a unit's entries
  ctl journalctl --no-pager -o verbose -u "$1" | sed -n "s/^ *$2=//p" | sort -u
}
worker_incarnations=$(fieldValues bulkhead-worker@0 BULKHEAD_INCARNATION)
broker_incarnations=$(fieldValues bulkhead-broker BULKHEAD_INCARNATION)
shared=$(comm -12 <(echo "$worker_incarnations") <(echo "$broker_incarnations") | grep -c . || true)
[ "$shared" -ge 3 ] ||
  fail "worker and broker entries share $shared incarnations (worker: $worker_incarnations; broker: $broker_incarnations)"
[ -n "$(fieldValues bulkhead-worker@0 BULKHEAD_WORKER)" ] || fail "worker entries lack BULKHEAD_WORKER"
"$bin/bulkhead" generate --server "127.0.0.1:$port" --tokens 1,2,3 --max-tokens 900 --ignore-eos \
  --timeout 0.05 --request-id nspawn-deadline > /dev/null 2>&1 && fail "a 50 ms deadline was met"
requestLogged() {
  grep -q "request nspawn-deadline ended: " \
    <<< "$(ctl journalctl --no-pager -o cat -u bulkhead-broker BULKHEAD_REQUEST_ID=nspawn-deadline)"
}
waitFor 10 requestLogged || {
  ctl journalctl --no-pager -o cat -u bulkhead-broker | tail -5
  fail "no broker entry with BULKHEAD_REQUEST_ID=nspawn-deadline"
}
log "journal fields: $shared incarnations in both processes' entries, a request found by its id"

# 4. A worker that cannot start: StartLimit, then the broker stops serving.
mkdir -p "$root/etc/systemd/system/bulkhead-worker@.service.d"
cat > "$root/etc/systemd/system/bulkhead-worker@.service.d/zz-broken.conf" << EOF
[Unit]
StartLimitIntervalSec=60
StartLimitBurst=3
[Service]
ExecStart=
ExecStart=/usr/local/bin/bulkhead-worker --model /nonexistent --backend cpu \
  --socket /run/bulkhead/worker-%i.sock
EOF
ctl systemctl daemon-reload
ctl systemctl kill -s SIGKILL bulkhead-worker@0
# systemd 252 keeps the last run's Result (exit-code); the limit shows as a failed unit that
# systemd no longer restarts, and its journal line.
limitHit() {
  [ "$(ctl systemctl show -p ActiveState --value bulkhead-worker@0)" = failed ] &&
    grep -q "Start request repeated too quickly" \
      <<< "$(ctl journalctl --no-pager -u bulkhead-worker@0)"
}
waitFor 60 limitHit || {
  ctl systemctl show -p Result -p NRestarts -p StartLimitBurst -p StartLimitIntervalUSec \
    -p ActiveState bulkhead-worker@0
  ctl journalctl --no-pager -u bulkhead-worker@0 | tail -8
  fail "the worker never hit its start limit"
}
notServing() {
  [[ $(ctl systemctl show -p StatusText --value bulkhead-broker) == "not serving"* ]]
}
waitFor 60 notServing || fail "broker status: $(ctl systemctl show -p StatusText --value bulkhead-broker)"
if out=$(generate 2>&1); then fail "a generation succeeded with no worker"; fi
grep -q UNAVAILABLE <<< "$out" || fail "a generation with no worker: $out"
log "StartLimit hit: broker not serving, requests UNAVAILABLE"
echo "systemd test passed"
