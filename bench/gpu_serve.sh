#!/usr/bin/env bash
# Sourced at the start of a device call (docs/benchmarks/engine.md): installs the service's missing
# wheels (.serve_whl/, ignored by git: bench/serve_wheels.sh builds it here), stores the random-weight
# Llama-3-8B model (bench/random_checkpoint.py) and starts `bentoml serve .` on it at
# 127.0.0.1:$SERVE_PORT (default 3000; log: /tmp/server.log, which bench/gpu_run.sh copies to $OUT;
# another port's server, the second of gpu_run.sh's `pair` stage, logs to /tmp/server_$SERVE_PORT.log),
# unless a server left by an earlier call on the same warm machine still answers there;
# `source bench/gpu_serve.sh --no-server` starts none.
[ -d /tmp/site/bentoml ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .serve_whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH BENTOML_HOME=/tmp/llama-home BENTOML_DO_NOT_TRACK=true
export PYTHONUNBUFFERED=1
SERVE_PORT=${SERVE_PORT:-3000}
SERVER="http://127.0.0.1:$SERVE_PORT"
SERVER_FILES=/tmp/server$([ $SERVE_PORT = 3000 ] || echo _$SERVE_PORT)  # .pgid, .log
[ "${1:-}" = --no-server ] && return 0  # the wheels and the environment only
if curl -sf "$SERVER/readyz" > /dev/null; then
    SERVER_GROUP=$(cat $SERVER_FILES.pgid)  # `kill -- -$SERVER_GROUP` stops it
    echo "server still up since an earlier call (process group $SERVER_GROUP)"
    return 0
fi
[ -d /tmp/llama-home/models/llama3-8b-random ] || python3 bench/random_checkpoint.py || return 1
LLGTRT_MODEL=llama3-8b-random LLGTRT_MAX_BATCH_SIZE=${MAX_BATCH:-256} LLGTRT_MAX_MODEL_LEN=2048 \
    setsid bentoml serve . --host 127.0.0.1 --port $SERVE_PORT > $SERVER_FILES.log 2>&1 &
SERVER_GROUP=$!  # `kill -- -$SERVER_GROUP` stops it
echo $SERVER_GROUP > $SERVER_FILES.pgid
# Each API worker answers /readyz for itself and they get ready one by one: one "ready" and the next
# "not yet" ended a wait early once. Ready: 8 answers in a row (each curl a new connection, any worker).
READY_IN_A_ROW=0
for _ in $(seq 600); do
    if curl -sf "$SERVER/readyz" > /dev/null; then
        READY_IN_A_ROW=$((READY_IN_A_ROW + 1)); [ $READY_IN_A_ROW -ge 8 ] && break
    else
        READY_IN_A_ROW=0; sleep 0.5
    fi
done
[ $READY_IN_A_ROW -ge 8 ] || { tail -50 $SERVER_FILES.log; return 1; }
echo "server ready: $(date -u +%H:%M:%S)"
