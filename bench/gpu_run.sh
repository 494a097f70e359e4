#!/usr/bin/env bash
# Issue 15's measurements on the device machine, in stages that each fit one call (10 minutes);
# the first stage that needs the server starts it (or finds an earlier call's, while the machine
# stays warm), so `bash bench/gpu_run.sh tests` alone starts none.
#   bash bench/gpu_run.sh tbt http engine tests
#   tbt     constrained_tbt: batch 1, 8, 64, 128, 256 x 3 rounds, then batch 256 x 6 rounds, each with a
#           random seed over the whole MaskBench pool (.serve_whl/maskbench_pool.jsonl.gz)
#   http    http_load: 256 streams for 30 s, 256 tokens each
#   engine  stops the server; engine_decode at batch 1 and 256 (the engine alone, and the roofline)
#   tests   stops the server (its KV cache would leave the tests too little memory); the GPU tests of the
#           engine, the constraint stage, the mask post-processor and kernel
#   control batch 128 and 256 x 6 rounds, A/A (--control: both waves unconstrained, the noise) then A/B,
#           on one random seed
#   apart   batch 128 and 256 x 3 rounds on $SEED (default: a random one) against a server restarted for each
#           mode in $APART_MODES (default "on off"): slow grammars' rows filled apart (on: the default) or
#           every row in the batch (off: llguidance.slow_mask_ms null); each with a step log and its sit-outs
#   ab      batch 128 and 256 x 3 rounds on one seed ($SEED, default a random one) against a server restarted
#           for each tree in turn ($AB_TREES, default base / current / base / current): base is the commit
#           bench/base_tree.sh put in .serve_whl/base, current the working tree (two versions of the code on
#           one machine); the engine process's threads sampled (bench/thread_switches.py). Four servers
#           outlast one 10-minute call on a fresh machine (session 27): AB_TREES="base current" twice instead
#   pair    batch 128 and 256, $PAIR_ROUNDS (default 6) rounds of one wave each on one seed ($SEED, default a random
#           one) against two servers up at once, base (.serve_whl/base, port 3001) and current (the working tree,
#           port 3000), the rounds interleaved (base first in odd rounds, current first in even ones) so that CPU
#           the hypervisor takes in a stretch falls on both; each server's KV cache bounded to $PAIR_KV_TOKENS
#           (default 196608) so that both fit; bench/pair_rounds.py pairs the rounds ($OUT/pair_rounds.txt;
#           every round's JSON and log in $OUT/pair.tar.gz). With $PAUSE_CORES, bench/thread_pauses.py stops
#           that many running threads of the servers at once on average, $PAUSE_MS (default 4) ms each, as the
#           hypervisor's paused vCPUs did (both trees alike; $OUT/thread_pauses_$PAUSE_CORES.log; $PAUSE_THREADS:
#           one group of threads only). $PAIR_PAUSES runs the rounds again under each of its conditions in turn,
#           on the same two servers: "none", CORES (all threads) or CORES@THREADS (a group, as $PAUSE_THREADS),
#           e.g. "none 0.3@torch-engine 0.5" (a fresh machine's two servers take ~150 s to start, each condition's
#           round ~60 s)
#   fill    bench/fill_step.py on this machine's host, 256 rows x 3 rounds (no GPU): how fast it fills masks,
#           then each row's mask alone on one seed (--per-row: the slowest row a batched fill waits for)
#           (in the server an H100 host's masks took 3.2-4.1 ms a step at batch 256, the H200s' 1.8-1.9,
#           engine.md "Session 21")
#   fillab  bench/fill_step.py, 256 rows x 64 steps x 3 rounds, on one seed ($SEED, default a random one) for
#           base / current / base / current (the trees of `ab`): the fill's host time a step of two versions
#   spy     step_profile: 256 closed-loop streams of 64 tokens, a plain window then a constrained one (20 s
#           each), py-spy sampling the GIL's holders in the server's processes halfway through each
#           (gil_*.txt, raw stacks: which functions of which thread hold the GIL), and the step's phases
#   spyab   spy's window pair (py-spy's GIL samples and the step's phases) on one seed ($SEED, default a random
#           one) against a server restarted for each tree in $AB_TREES (default base / current, as `ab`):
#           spy_<run>_<tree>/
#   threads batch 256 x 6 rounds on one seed ($SEED, default a random one) against a server restarted for
#           each mask-fill pool size in $MASK_THREADS_LIST (default "default 8 4"; "default": llguidance's),
#           each with a step log
#   switches batch 128 and 256 x 3 rounds on one seed ($SEED, default a random one) with the engine process's
#           threads sampled (bench/thread_switches.py: CPU, voluntary and involuntary context switches a
#           step), against a server restarted for each loop-guard mode in $GUARD_MODES (default "on off")
#   pauses  batch 128 and 256 x 3 rounds on one seed ($SEED, default a random one) against the server up, first
#           with no thread stopped, then with bench/thread_pauses.py stopping $PAUSE_CORES (default 1; a list
#           such as "0.5 1" runs each in turn) of the server's running threads at once on average, $PAUSE_MS
#           (default 4) ms each: the hypervisor's paused vCPUs on demand, where the thief's cores were taken over
#           by idle ones (engine.md "Session 37"); $PAUSE_THREADS (regular expressions over the threads' names,
#           llgtrt_core/os_threads.py: torch-engine, mask-fill, llg-masks, loop-guard; a list, such as
#           "torch-engine llg-masks", pauses each group in turn after one unpaused half) stops only those
#           (here and in `pair`, one group there)
#   gilpauses bench/gil_share.py's modes (the gil stage's) on one seed, with no thread stopped, then with
#           bench/thread_pauses.py stopping $PAUSE_CORES of gil_share's (and its fill process's) at once
#   gil     bench/gil_share.py on this machine's host (no GPU): an engine-thread stand-in beside the fill of 256
#           rows, the fill on a thread (as the server runs it) or in a process of its own, on one seed ($SEED,
#           default a random one), first with nothing taken, then with bench/cpu_thief.py taking $THIEF_CORES
#   gilab   bench/gil_share.py's none and thread modes for base / current / base / current (the trees of `ab`) on
#           one seed ($SEED, default a random one): what two versions of the fill cost the engine thread
#   thief   batch 128 and 256 x 3 rounds on one seed ($SEED, default a random one) against the server up, first
#           with nothing taken, then with bench/cpu_thief.py taking $THIEF_CORES (default 2) cores in bursts of
#           $THIEF_BURST_MS (default 4) ms, as the hypervisor took them in the runs that missed (engine.md "Session 32";
#           half a core did nothing, two cores slowed the json_schema waves: "Session 33")
# Everything lands in $OUT (the server's log as server.log).
set -u
source bench/gpu_serve.sh --no-server || exit 1
serve() { source bench/gpu_serve.sh || exit 1; }  # the server this call's stages share (an earlier call's, if up)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
D=.serve_whl/maskbench_pool.jsonl.gz
# The servers up, as bench/thread_pauses.py's --pid arguments (it adds their API workers, engine process and fill's)
servers() { for pgid in /tmp/server*.pgid; do echo --pid $(cat $pgid); done; }
stolen_s() { awk '/^cpu /{printf "%.1f", $9 / 100}' /proc/stat; }  # the host's CPU seconds the hypervisor took
random_seed() { python3 -c 'import random; print(random.randrange(2**31))'; }  # one draw for runs to compare
stop_server() {  # this call's server or an earlier call's (its KV cache holds most of the GPU's memory)
    # Every one started, whichever shell started it (from the pid files): $SERVER_GROUP is this
    # shell's, and a base tree's server (ab, pair) starts in a subshell.
    local pgid
    for pgid in /tmp/server*.pgid; do  # both of the `pair` stage's
        if [ -f $pgid ]; then kill -- -$(cat $pgid) 2>/dev/null; rm -f $pgid; fi
    done
    # The API workers and the engine process have process groups of their own and outlive the
    # arbiter by seconds: a benchmark started beside a dying engine process measured 22k tok/s, not 27k.
    for _ in $(seq 60); do pgrep -f "llgtrt_core.engine.core_process|_bentoml_impl.worker" > /dev/null || break; sleep 1; done
    sleep 2
}
serve_tree() {  # a fresh server of `base` (.serve_whl/base, bench/base_tree.sh) or `current` (the working tree)
    [ -f .serve_whl/base/REVISION ] || { echo "no .serve_whl/base: bash bench/base_tree.sh REV"; exit 1; }
    stop_server
    if [ $1 = base ]; then (cd .serve_whl/base && source ../../bench/gpu_serve.sh) || exit 1; else serve; fi
    echo "-- $1 ($([ $1 = base ] && cat .serve_whl/base/REVISION || echo working tree)), served from" \
        "$(readlink /proc/$(cat /tmp/server.pgid)/cwd)"
}
waves_128_256() {  # URL ROUNDS JSON [FLAGS]: constrained_tbt at batch 128 and 256 on $SEED, its per-wave table left out
    python3 bench/constrained_tbt.py --url $1 --batch 128,256 --rounds $2 --max-tokens 64 --seed $SEED --data $D \
        --json $3 "${@:4}" | grep -v "^|"
}
sampled_tbt() {  # batch 128 and 256 x 3 rounds on $SEED against the server up, its engine process's threads
    # sampled: $OUT/constrained_tbt_$1.json, $OUT/threads_$1.jsonl, and the switches a step per wave
    python3 bench/thread_switches.py sample --pid $(pgrep -f llgtrt_core.engine.core_process | head -1) \
        --out $OUT/threads_$1.jsonl &
    local sampler=$!
    waves_128_256 $SERVER 3 $OUT/constrained_tbt_$1.json
    kill $sampler
    python3 bench/thread_switches.py waves --samples $OUT/threads_$1.jsonl --tbt $OUT/constrained_tbt_$1.json
}
start_thief() {  # CORES: bench/cpu_thief.py taking CORES until stop_thief (it ends on its own too)
    python3 bench/cpu_thief.py --cores $1 --burst-ms ${THIEF_BURST_MS:-4} --seconds 300 &
    TAKER=$!
}
stop_thief() { kill $TAKER; wait $TAKER; }
start_pauses() {  # CORES: bench/thread_pauses.py stopping CORES of $PAUSE_TARGETS' threads ($THREADS: those whose
    # names match it, or all) at once until stop_pauses
    PAUSES_LOG=$OUT/thread_pauses_$1$(suffix).log
    local only=()  # an array: the regular expression must reach the tool as it is, never globbed
    [ "$THREADS" != all ] && only=(--threads "$THREADS")
    python3 bench/thread_pauses.py --cores $1 --pause-ms ${PAUSE_MS:-4} --seconds 590 \
        "${only[@]}" $PAUSE_TARGETS > $PAUSES_LOG 2>&1 &
    TAKER=$!
}
stop_pauses() { kill $TAKER; wait $TAKER; tail -1 $PAUSES_LOG; }
suffix() { [ "$THREADS" = all ] || echo "_${THREADS//|/_or_}"; }  # a file name's mark of the threads paused
halves() {  # thief|pauses "CORES..." "$@": "$@" with nothing taken, then with start_thief / start_pauses
    # at each of CORES in turn, pauses of each of $PAUSE_THREADS' groups in turn ($TAKER_KIND, $CORES and $THREADS say which)
    local taker=$1 cores=$2
    shift 2
    TAKER_KIND=$taker
    for CORES in 0 $cores; do
        for THREADS in $([ $CORES = 0 ] || [ $taker = thief ] && echo all || echo ${PAUSE_THREADS:-all}); do
            echo "-- $([ $taker = thief ] && echo "CPU taken by bench/cpu_thief.py: $CORES cores" ||
                echo "threads stopped by bench/thread_pauses.py ($PAUSE_TARGETS, threads: $THREADS): $CORES at once on average")"
            [ $CORES != 0 ] && start_$taker $CORES
            "$@"
            [ $CORES != 0 ] && stop_$taker
        done
    done
}
each_tree() {  # "$@" in base / current / base / current: .serve_whl/base (bench/base_tree.sh), the working tree
    for TREE in base current base current; do
        echo "-- $TREE"
        (if [ $TREE = base ]; then cd .serve_whl/base; fi; "$@")
    done
}
fill_step_tree() { python3 bench/fill_step.py --rows 256 --steps 64 --rounds 3 --seed $SEED --data $DATA 2>&1 | grep -E "^  |^seed|CPUs"; }
gil_share() { python3 bench/gil_share.py --rows 256 --steps 150 --rounds 3 --seed $SEED "$@" 2>&1 | grep -v "nanobind\|leaked\|skipped remainder"; }
halves_tbt() { waves_128_256 $SERVER 3 $OUT/constrained_tbt_${TAKER_KIND}_$CORES$(suffix).json; }  # halves' command
for stage in "$@"; do
    echo "== $stage $(date -u +%H:%M:%S), CPU seconds stolen so far $(stolen_s)"
    case $stage in
    tbt)
        serve
        python3 bench/constrained_tbt.py --url $SERVER --batch 1,8,64,128,256 --rounds 3 --max-tokens 64 \
            --data $D --json $OUT/constrained_tbt_sweep.json
        python3 bench/constrained_tbt.py --url $SERVER --batch 256 --rounds 6 --max-tokens 64 \
            --data $D --json $OUT/constrained_tbt_256.json ;;
    http)
        serve
        python3 bench/http_load.py --url $SERVER --clients 256 --seconds 30 --max-tokens 256 \
            --json $OUT/http_load.json ;;
    engine)
        stop_server
        python3 bench/engine_decode.py --batches 1 256 --hf-batches --out $OUT ;;
    control)
        serve
        SEED=$(random_seed)
        for RUN in aa ab; do
            waves_128_256 $SERVER 6 $OUT/constrained_tbt_$RUN.json $([ $RUN = aa ] && echo --control)
        done ;;
    spy)
        serve
        python3 bench/step_profile.py --url $SERVER --clients 256 --seconds 20 --rounds 1 --max-tokens 64 \
            --data $D --py-spy --py-spy-dir $OUT --json $OUT/step_profile.json ;;
    spyab)
        SEED=${SEED:-$(random_seed)}
        RUN=0
        for TREE in ${AB_TREES:-base current}; do
            RUN=$((RUN + 1))
            serve_tree $TREE
            python3 bench/step_profile.py --url $SERVER --clients 256 --seconds 20 --rounds 1 --max-tokens 64 \
                --data $D --seed $SEED --py-spy --py-spy-dir $OUT/spy_${RUN}_$TREE \
                --json $OUT/spy_${RUN}_$TREE/step_profile.json
        done
        stop_server ;;
    threads)
        SEED=${SEED:-$(random_seed)}
        for T in ${MASK_THREADS_LIST:-default 8 4}; do
            stop_server
            export LLGTRT_MASK_THREADS=${T#default} LLGTRT_STEP_LOG=$OUT/steps_$T.jsonl
            source bench/gpu_serve.sh || exit 1
            python3 bench/constrained_tbt.py --url $SERVER --batch 256 --rounds 6 --max-tokens 64 --seed $SEED \
                --data $D --json $OUT/constrained_tbt_threads_$T.json | grep -v "^|"
        done
        unset LLGTRT_MASK_THREADS LLGTRT_STEP_LOG ;;
    fill)
        SEED=$(random_seed)
        python3 bench/fill_step.py --rows 256 --steps 64 --rounds 3 --seed $SEED --data $D | grep -v "^round"
        python3 bench/fill_step.py --rows 256 --steps 64 --rounds 3 --seed $SEED --data $D --per-row ;;
    fillab)
        SEED=${SEED:-$(random_seed)}
        DATA=$PWD/$D
        each_tree fill_step_tree ;;
    ab)
        SEED=${SEED:-$(random_seed)}
        RUN=0
        for TREE in ${AB_TREES:-base current base current}; do
            RUN=$((RUN + 1))
            serve_tree $TREE
            sampled_tbt ab${RUN}_$TREE
        done
        stop_server ;;
    pair)
        SEED=${SEED:-$(random_seed)}
        stop_server
        rm -rf /tmp/pair && mkdir /tmp/pair
        [ -d /tmp/llama-home/models/llama3-8b-random ] || python3 bench/random_checkpoint.py || exit 1
        echo "{runtime: {kv_cache_max_tokens: ${PAIR_KV_TOKENS:-196608}}}" > /tmp/pair.json5
        export LLGTRT_CONFIG=/tmp/pair.json5
        (cd .serve_whl/base && SERVE_PORT=3001 && source ../../bench/gpu_serve.sh) &
        BASE_STARTING=$!
        serve
        wait $BASE_STARTING || exit 1
        unset LLGTRT_CONFIG
        echo "-- base $(cat .serve_whl/base/REVISION) on port 3001 (process group $(cat /tmp/server_3001.pgid)), current" \
            "(working tree) on port 3000 (process group $(cat /tmp/server.pgid)); seed $SEED"
        PAUSE_TARGETS=$(servers)
        : > $OUT/pair_rounds.txt
        for CONDITION in ${PAIR_PAUSES:-$([ -n "${PAUSE_CORES:-}" ] && echo "$PAUSE_CORES@${PAUSE_THREADS:-all}" || echo none)}; do
            CORES=${CONDITION%%@*}
            case $CONDITION in *@*) THREADS=${CONDITION#*@} ;; *) THREADS=all ;; esac
            LABEL=$([ $CORES = none ] && echo none || echo pauses_$CORES$(suffix))
            mkdir -p /tmp/pair/$LABEL
            echo "-- $LABEL" | tee -a $OUT/pair_rounds.txt
            [ $CORES != none ] && start_pauses $CORES
            for ROUND in $(seq ${PAIR_ROUNDS:-6}); do
                for TREE in $([ $((ROUND % 2)) = 1 ] && echo base current || echo current base); do
                    WAVES=/tmp/pair/$LABEL/pair_${ROUND}_$TREE
                    waves_128_256 http://127.0.0.1:$([ $TREE = base ] && echo 3001 || echo 3000) 1 $WAVES.json > $WAVES.log 2>&1
                    [ -f $WAVES.json ] || tail -5 $WAVES.log
                done
            done
            [ $CORES != none ] && stop_pauses
            python3 bench/pair_rounds.py /tmp/pair/$LABEL/pair_*.json | tee -a $OUT/pair_rounds.txt
        done
        cp /tmp/server_3001.log /tmp/pair/server_base.log
        tar czf $OUT/pair.tar.gz -C /tmp pair  # one file: the device returns a few dozen at most
        stop_server ;;
    apart)
        SEED=${SEED:-$(random_seed)}
        echo '{llguidance: {slow_mask_ms: null}}' > /tmp/apart_off.json5
        for MODE in ${APART_MODES:-on off}; do
            stop_server
            export LLGTRT_STEP_LOG=$OUT/steps_apart_$MODE.jsonl
            if [ $MODE = off ]; then export LLGTRT_CONFIG=/tmp/apart_off.json5; else unset LLGTRT_CONFIG; fi
            source bench/gpu_serve.sh || exit 1
            waves_128_256 $SERVER 3 $OUT/constrained_tbt_apart_$MODE.json
            curl -s $SERVER/metrics | grep "^llgtrt:grammar_mask_sit_outs_total"
            grep -h "token masks take" /tmp/server.log | cut -c1-200
        done
        unset LLGTRT_CONFIG LLGTRT_STEP_LOG ;;
    switches)
        SEED=${SEED:-$(random_seed)}
        echo '{llguidance: {loop_guard: {enabled: false}}}' > /tmp/guard_off.json5
        for MODE in ${GUARD_MODES:-on off}; do
            stop_server
            if [ $MODE = off ]; then export LLGTRT_CONFIG=/tmp/guard_off.json5; else unset LLGTRT_CONFIG; fi
            source bench/gpu_serve.sh || exit 1
            echo "-- loop guard $MODE"
            sampled_tbt guard_$MODE
        done
        stop_server  # a later stage would find this mode's server up and measure it
        unset LLGTRT_CONFIG ;;
    thief)
        serve
        SEED=${SEED:-$(random_seed)}
        halves thief ${THIEF_CORES:-2} halves_tbt ;;
    pauses)
        serve
        SEED=${SEED:-$(random_seed)}
        PAUSE_TARGETS=$(servers)
        halves pauses "${PAUSE_CORES:-1}" halves_tbt ;;
    gilpauses)
        SEED=${SEED:-$(random_seed)}
        PAUSE_TARGETS="--match bench/gil_share.py"
        halves pauses "${PAUSE_CORES:-1}" gil_share --data $D ;;
    gil)
        SEED=${SEED:-$(random_seed)}
        halves thief ${THIEF_CORES:-2} gil_share --data $D ;;
    gilab)
        SEED=${SEED:-$(random_seed)}
        each_tree gil_share --modes "none thread" --data $PWD/$D ;;
    tests)
        stop_server
        python3 -m pytest -q -x tests/test_engine_gpu.py tests/test_scheduler.py tests/test_constraint_stage.py \
            tests/test_host_gate.py tests/test_fill_process_gpu.py tests/test_constraints_postprocessor.py \
            tests/test_sampler.py tests/test_mask_kernel.py 2>&1 | tail -5 ;;
    esac
done
cp /tmp/server.log $OUT/server.log 2>/dev/null
echo "== done $(date -u +%H:%M:%S), CPU seconds stolen so far $(stolen_s)"
