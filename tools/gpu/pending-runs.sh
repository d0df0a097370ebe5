#!/usr/bin/env bash
# On the GPU host, from a bundle made by tools/gpu/bundle.sh: the measurements the open issues
# still wait for, in groups that each fit one device call (10 minutes). Models are made there.
# Usage: tools/gpu/pending-runs.sh BUNDLE OUTDIR|tar:OUTDIR GROUP...
#   cpu     the CPU backend on that host's cores (the broker at GPU speed): sample-bench,
#           step-bench (defaults; the broker not watching for replies awake; watching 200 us
#           either side) and serve-bench on tiny-v152k
#   cpu-c1  serve-bench on tiny-v152k at concurrency 1 (16 requests), the broker's sampling pool
#           as made by default and limited to 4 threads: whether the c1 stalls beside a CPU
#           worker are the pool's helpers waiting for cores the worker's threads hold; then
#           step-bench and serve-bench c1 with the worker watching its socket awake for 200 us
#           after each reply (--spin-us: whether its wake-up is the step's "to_worker" piece),
#           and with a quarter of the cores spinning while the broker's pool is warm instead of
#           the eighth it keeps beside a CPU worker (--warm-spinners)
#   cpu-worker-spin step-bench and serve-bench on tiny-v152k with the worker watching its socket
#           awake for 100 us after each reply; step-bench of a 0.5B CUDA worker without and with
#   gpu-spin step-bench and serve-bench of a 0.5B CUDA worker at b1 / c1 and 32, as by default,
#           with the worker watching its socket awake 200 us after each reply, with the broker
#           watching 200 us for each reply, and with both: the round trip's wake-ups beside a GPU
#   workers serve-bench at concurrency 64 behind 1, 2 and 4 CPU workers
#   tests   the GPU tests, in four shards side by side
#   gemm    the product's GPU tests, then gemm-bench
#   gemm-bench bench-gemm (each schedule and cuBLAS) on both shapes
#   memcheck the product's tests on the small shapes under compute-sanitizer (memcheck, then
#           racecheck for the cluster's shared memory)
#   engine  bench-engine on qwen2.5-0.5b and qwen2.5-7b, with and without programmatic launch
#   stream  the GPU tests of weights streamed from host memory, then bench-engine on both shapes
#           with every weight resident and under device budgets (--weight-budget), then chaos
#           against a 0.5B worker streaming part of its weights
#   times   bench-engine --kernel-times on both shapes at batch 1 and 32: where a step's
#           device time goes, launch by launch, with and without the checks
#   prefill-times bench-engine --kernel-times on both shapes with one 2,048-token prompt a
#           step: where a prefill step's device time goes (products, attention, the rest)
#   residual the GPU tests of products that add into the residual stream, normalise their own
#           tokens or compute their own activation, then both shapes' kernel times with the
#           first, and bench-engine with all three (compare with `times` and `engine`)
#   fusions bench-engine on both shapes with the products adding into the residual stream,
#           normalising their own tokens and computing their own activation, alone and together
#           (captured steps: what `residual` measured uncaptured)
#   rope    the GPU tests of the attention that does the q/k/v kernel's work in decode steps,
#           then bench-engine on both shapes with --rope-in-attention off and on
#   tiles   the GPU tests of attention in prefill tiles, then bench-engine on qwen2.5-7b at
#           prompt 8,192 with --attention-tiles off and on (prefill tokens/s)
#   schedules bench-engine on both shapes with each product schedule (plain, pipelined,
#           two_tiles, interleaved) in every bucket, no comparison columns
#   prefill the product tests, then bench-engine prefill on both shapes (prompts of 2,048 tokens,
#           a step of 2,048 rows) with the 33+ row bucket pipelined (its token blocks side by
#           side over 64 rows), plain (token blocks along y), interleaved and tiled
#   tiled   the product tests (the tiled schedule among them), then bench-engine on both shapes:
#           decode at 33 to 256 rows (and the prefill of their 128-token prompts), prefill of one
#           2,048-token prompt a step; the bucket of 33+ rows pipelined against tiled (the default
#           from 96 rows)
#   cublas  the cuBLAS products' GPU tests (the model cases and the matmul's invariance to 2,048
#           rows), and bench-engine on the 7B with them and with ours
#   splits  bench-engine with other split counts for some product shapes (--gemm-splits)
#   shape-schedules bench-engine at 48 and 64 rows with schedules per product shape
#           (--gemm-shape-schedules)
#   cublas-probe whether workspace-0 cuBLAS keeps each row's bits at 1 to 2,048 rows on the
#           Qwen2.5 product shapes, which algorithm cuBLASLt picks at each, and their speed
#           (tools/gpu/cublas_probe.cu, built there)
#   persistent-probe one-row decode steps of both shapes as synthetic work of the real sizes, one
#           kernel a phase (a graph, programmatic launch) against one persistent kernel whose
#           groups await each phase by counters: what a persistent decoder could gain
#           (tools/gpu/persistent_probe.cu, built there)
#   wgmma-probe whether Hopper's wgmma (A in registers or in shared memory) rounds a k16
#           step as mma.sync does (tools/gpu/mma_equality_probe.cu, built there)
#   context bench-engine on both shapes at prompt 128 and 2,048 (b1, 8, 32; the prompts prefilled
#           whole): what a longer context adds to a decode step, on one card and one build, then
#           the kernel times of a 7B b1 step after a 2,048-token prompt
#   attention-ncu ncu (the full set) on one launch of the prefill attention kernel (tiles) and
#           one of the gate/up product, in a 7B prefill of a 2,048-token prompt: what bounds them
#   attention-probe a tensor-core attention's invariance (an item alone in a tile against as
#           prefill, decode and a shuffle take it, bit for bit, head sizes 64 and 128), accuracy,
#           and one layer's prefill and 32-row decode time at both shapes
#           (tools/gpu/attention_mma_probe.cu, built there)
#   logits  the GPU tests of lm_head storing its rows itself (and of every row's checksum), then
#           bench-engine on both shapes at 1-64 rows with --logits-in-product on and off
#   timeline-checks the timeline of steps of 1 and 32 rows on both shapes, with bench-engine's
#           comparison runs (checks off, cuBLAS products) as graphs of their own: what each
#           kernel's checks cost in the captured steps (a line per kernel and grid, with its
#           effective time; a checked product's grid has its check blocks past the unchecked one's;
#           TIMELINE_SHAPES: fewer shapes; TIMELINE_BATCHES: other batch sizes)
#   paired-chunks the long-context GPU tests, then bench-engine on the 0.5B with attention's
#           chunks taken two at a time up to 0 (off), 8 and 64 rows (--attention-paired-rows)
# After the groups that run builds or options in turn (ab, ab-checks, paired, paired-engine,
# paired-chunks), tools/gpu/ab-table.py prints their step times side by side.
#   ab      bench-engine on both shapes, BUNDLE/bulkhead-base (another build) and any
#           BUNDLE/bulkhead-ab-* (more builds) against this bundle's bulkhead, twice each, in turn
#   ab-checks the same with the checks' and cuBLAS columns (AB_SHAPES: fewer shapes; AB_BUILDS:
#           fewer builds, by name, e.g. "base ab-s128")
#   mma     the GPU tests of attention on the tensor cores (the *_mma model cases, the long
#           context ones), then bench-engine on both shapes with --attention-mma off and on:
#           decode at prompt 128 and 2,048 (and the 2,048-token prefill), and the 7B at b1 / b64
#           with programmatic launch off (the b64 loss is in the overlap with its neighbours)
#   paired  the product tests (every schedule bit for bit), bench-gemm at 32 and 64 rows, then
#           bench-engine on both shapes at 40-64 rows, twice each in turn: the default (the
#           paired schedule, two cells a block, where k is split and n <= k) against those
#           products pipelined (the rule before)
#   paired-engine that group's bench-engine runs alone
#   product-ncu ncu (the full set) on the first layer's gate/up (two tiles a warp) and down
#           (pipelined) products of a 7B decode step of 64 rows: what bounds them there (the
#           L2 cache's throughput, the tokens' reloads, latency)
#   timeline every kernel of the 0.5B's captured decode steps at b1 and b8, then the 7B's at b1
#           and b64 with attention on the CUDA
#           cores and on the tensor cores, from CUPTI (tools/gpu/kernel_timeline.cpp, LD_PRELOAD;
#           the bundle's libkernel_timeline.so, else built there), summarised by
#           tools/gpu/timeline.py: each kernel's time and its gap from the one before, in the
#           steps as they run (programmatic overlaps included)
#   long    the long-context attention test, then bench-engine on qwen2.5-7b at prompt 8,192
#           (batch 1 and 8, the prompts prefilled in steps of 8,192 tokens: attention's splits
#           side by side)
#   serve   serve-bench through a broker with the CUDA backend on both (and its share of
#           bench-engine's tokens/s, tools/gpu/e2e-ratios.py, after `engine` in the same call)
#   cuda    tests, engine and serve
#   start   a 7B worker's start, phase by phase, then chaos with the CUDA backend on the 7B
#           (worker_kill recovery is the kill-to-serving time)
#   h200    what the open issues wait for on the H200, most needed first: cpu twice, engine,
#           serve, tests, start (with PENDING_BUDGET_S, 570 unless set)
# PENDING_BUDGET_S: a group starts only while this many seconds of the call leave it the time it
# is expected to take (its figure below; groups without one always start), so that a call ends
# with whole groups rather than one cut off by the call's limit.
set -uo pipefail
bundle=$1 out=$2
shift 2
# OUTDIR as tar:DIR: the runs' files go to a scratch folder and end up in DIR/results.tgz (one
# file, however many runs; also when the script is stopped by a timeout's TERM).
if [[ $out == tar:* ]]; then
  tar_to=${out#tar:} out=$(mktemp -d)
  scratch=$out
  trap 'tar czf "$tar_to/results.tgz" -C "$scratch" .; exit' EXIT TERM INT
fi
export LD_LIBRARY_PATH=$bundle/lib BULKHEAD_FIXTURES_DIR=$bundle/fixtures
# Other builds for the ab groups, packed by bundle.sh (BUNDLE_AB).
[ -f "$bundle/variants.tar.xz" ] && tar xJf "$bundle/variants.tar.xz" -C "$bundle"
# BULKHEAD_BIN: another build's bulkhead beside the bundle's (the same libraries), to compare two
# builds on one card in one call: BULKHEAD_BIN=BUNDLE/bulkhead-main pending-runs.sh ...
bh=${BULKHEAD_BIN:-$bundle/bulkhead}
model() {  # model SHAPE: made once per host
  local m=/tmp/bulkhead-$1
  [ -d "$m" ] || timeout 300 "$bh" make-model --shape "$1" --out "$m" > /dev/null
  echo "$m"
}
run() {  # run NAME TIMEOUT COMMAND...: output to OUTDIR/NAME.txt, the tables to stdout
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "rc=$? in $((SECONDS - t0)) s"
  grep -v '^\[\|^20[0-9][0-9]-' "$out/$name.txt" | tail -40
}
timelineLib() {  # the CUPTI kernel timeline to preload: the bundle's, else built here
  local lib=$bundle/libkernel_timeline.so
  [ -f "$lib" ] || g++ -std=c++17 -O2 -shared -fPIC -I/usr/local/cuda/include -o "$lib" \
    tools/gpu/kernel_timeline.cpp -L/usr/local/cuda/lib64 -lcupti
  echo "$lib"
}
alternate() {  # alternate SUFFIX BENCH_ENGINE_FLAGS...: BUNDLE/bulkhead-base (another build's
  # bulkhead), any BUNDLE/bulkhead-ab-* (more builds) and the bundle's own, in turn, twice each on
  # one card, on both shapes
  local suffix=$1 shape m rep v variants=()
  shift
  # AB_BUILDS: only these (names such as "base ab-s128"; the bundle's own always runs).
  for v in "$bundle"/bulkhead-base "$bundle"/bulkhead-ab-*; do
    [ -x "$v" ] || continue
    v=${v#"$bundle"/bulkhead-}
    [ -z "${AB_BUILDS:-}" ] || [[ " $AB_BUILDS " == *" $v "* ]] && variants+=("-$v")
  done
  variants+=("")
  for shape in ${AB_SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do  # AB_SHAPES: fewer, to fit a call
    m=$(model $shape)
    for rep in 1 2; do
      for v in "${variants[@]}"; do
        run "bench-engine-$shape$v$suffix-$rep" 150 "$bundle/bulkhead$v" bench-engine \
          --model "$m" --backend cuda --batch 1,8,32,64 "$@"
      done
    done
  done
}
optionVariants() {  # optionVariants NAME OPTION BATCHES SHAPE VALUE...: bench-engine on SHAPE
  # with OPTION VALUE for each VALUE ("default": without it), each in turn, twice, on one card
  local name=$1 option=$2 batches=$3 shape=$4 m rep v flags
  shift 4
  m=$(model "$shape")
  for rep in 1 2; do
    for v in "$@"; do
      flags=()
      [ "$v" = default ] || flags=("$option" "$v")
      run "bench-engine-$shape-$name-$v-$rep" 120 "$bh" bench-engine --model "$m" \
        --backend cuda --batch "$batches" --no-compare "${flags[@]}"
    done
  done
}
probe() {  # probe NAME TIMEOUT NVCC_FLAGS...: tools/gpu/NAME.cu built here, then run
  local name=$1 limit=$2 nvcc=/usr/local/cuda/bin/nvcc
  shift 2
  [ -x "$nvcc" ] || nvcc=nvcc
  "$nvcc" "$@" -o "$bundle/$name" "tools/gpu/$name.cu" && run "$name" "$limit" "$bundle/$name"
}
nproc
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# A group named again writes into OUTDIR/GROUP-N (its N-th run), so no run overwrites another's.
declare -A times_run
# Seconds a group is expected to take on a 16-core host, with room to spare: cpu (two runs took
# 115 s) and tests (four shards in about 50 s) from earlier calls, the others estimates; the
# first group that makes the 7B model takes about a minute more.
declare -A usual=([cpu]=90 [engine]=200 [serve]=240 [tests]=80 [start]=240 [gpu-spin]=270 [stream]=330)
first_out=$out
for group in "$@"; do
  if [ -n "${PENDING_BUDGET_S:-}" ] && (( SECONDS + ${usual[$group]:-0} > PENDING_BUDGET_S )); then
    echo "== $group: not started ($SECONDS s gone of $PENDING_BUDGET_S, it is given ${usual[$group]} s)"
    continue
  fi
  times_run[$group]=$(( ${times_run[$group]:-0} + 1 ))
  out=$first_out
  if (( times_run[$group] > 1 )); then
    out=$first_out/$group-${times_run[$group]}
    mkdir -p "$out"
  fi
  case $group in
    cpu)
      m=$(model tiny-v152k)
      lscpu | grep -E "^Model name|^Socket|^Core|^Thread|^NUMA node\(s\)|^L3" | tee "$out/host.txt"
      run sample-bench 90 "$bh" sample-bench --vocab 152064 --rows 1,32,64 --iterations 100 \
        --threads 4,8,16
      # The 8-lane passes (the same results): whether this processor runs them faster.
      run sample-bench-8-lanes 60 "$bh" sample-bench --vocab 152064 --rows 1,32,64 \
        --iterations 100 --threads 16 --lanes 8
      run step-bench-cpu 150 "$bh" step-bench --model "$m" --batches 1,32,64 --iterations 200
      run step-bench-cpu-no-reply-spin 150 "$bh" step-bench --model "$m" --batches 1,32,64 \
        --iterations 200 --reply-spin-us 0
      run step-bench-cpu-reply-spin-200 150 "$bh" step-bench --model "$m" --batches 1,32,64 \
        --iterations 200 --reply-spin-us 200
      run serve-bench-cpu 240 "$bh" serve-bench --model "$m" --concurrency 1,32,64 \
        --json "$out/serve-bench-cpu.json"
      ;;
    cpu-worker-spin)
      m=$(model tiny-v152k)
      run step-bench-cpu-worker-spin-100 150 "$bh" step-bench --model "$m" --batches 1,32,64 \
        --iterations 200 --worker-arg=--spin-us=100
      run serve-bench-cpu-worker-spin-100 240 "$bh" serve-bench --model "$m" \
        --concurrency 1,32,64 --worker-arg=--spin-us=100
      # A CUDA worker's host threads idle while it computes: the same watch there.
      m=$(model qwen2.5-0.5b)
      for spin in 0 100; do
        run "step-bench-cuda-worker-spin-$spin" 150 "$bh" step-bench --model "$m" --backend cuda \
          --batches 1,32,64 --iterations 200 --worker-arg=--spin-us=$spin
      done
      ;;
    cpu-c1)
      m=$(model tiny-v152k)
      for threads in 0 4; do
        run "serve-bench-cpu-c1-threads-$threads" 120 "$bh" serve-bench --model "$m" \
          --concurrency 1 --requests-per-stream 16 --broker-arg=--sampling-threads=$threads
      done
      run step-bench-cpu-worker-spin 150 "$bh" step-bench --model "$m" --batches 1,32,64 \
        --iterations 200 --worker-arg=--spin-us=200
      run serve-bench-cpu-c1-worker-spin 120 "$bh" serve-bench --model "$m" --concurrency 1 \
        --requests-per-stream 16 --worker-arg=--spin-us=200
      quarter=$(($(nproc) / 4))
      run step-bench-cpu-spinners-quarter 150 "$bh" step-bench --model "$m" --batches 1,32,64 \
        --iterations 200 --warm-spinners $quarter
      run serve-bench-cpu-c1-spinners-quarter 120 "$bh" serve-bench --model "$m" --concurrency 1 \
        --requests-per-stream 16 --broker-arg=--warm-spinners=$quarter
      ;;
    gpu-spin)
      m=$(model qwen2.5-0.5b)
      for flags in "" "--worker-arg=--spin-us=200" "--broker-arg=--reply-spin-us=200" \
        "--worker-arg=--spin-us=200 --broker-arg=--reply-spin-us=200"; do
        name=$(echo "${flags:-default}" | tr -c 'a-z0-9\n' '-')
        # step-bench takes the broker's watch as its own flag
        step_flags=${flags//--broker-arg=--reply-spin-us/--reply-spin-us}
        run "step-bench-cuda-$name" 120 "$bh" step-bench --model "$m" --backend cuda \
          --batches 1,32 --iterations 200 $step_flags
        run "serve-bench-cuda-$name" 150 "$bh" serve-bench --model "$m" --backend cuda \
          --concurrency 1,32 $flags
      done
      ;;
    workers)
      m=$(model tiny-v152k)
      run serve-bench-cpu-workers 200 "$bh" serve-bench --model "$m" --concurrency 64 \
        --workers 1,2,4 --json "$out/serve-bench-cpu-workers.json"
      ;;
    tests)
      # Four shards side by side on the one card: the suite in about a quarter of its time.
      for i in 0 1 2 3; do
        GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i run "gpu-tests-$i" 450 "$bundle/gpu_tests" \
          > "$out/gpu-tests-$i.summary" &
      done
      wait
      cat "$out"/gpu-tests-*.summary
      grep -h -E '^\[  (PASSED|FAILED) ' "$out"/gpu-tests-*.txt
      ;;
    gemm)
      run gemm-tests 200 "$bundle/gpu_tests" --gtest_filter='*Gemm*:*ProductFold*'
      "$0" "$bundle" "$out" gemm-bench
      ;;
    gemm-bench)
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        run "bench-gemm-$shape" 120 "$bh" bench-gemm --shape $shape --json "$out/bench-gemm-$shape.json"
      done
      ;;
    memcheck)
      small='*GemmGpuTest*/896x896:*GemmGpuTest*/128x64:*GemmGpuTest*/352x64:*GemmGpuTest*/64x176'
      small+=':*GemmGpuTest*/10x24:*GemmGpuTest*/33x40:*GemmGpuTest*/100x4008:TokenChecks*'
      for tool in memcheck racecheck; do
        run "gemm-$tool" 240 compute-sanitizer --tool $tool --error-exitcode 3 \
          "$bundle/gpu_tests" --gtest_filter="$small"
      done
      ;;
    engine)
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        run "bench-engine-$shape" 200 "$bh" bench-engine --model "$m" --backend cuda \
          --batch 1,8,32,64 --json "$out/bench-engine-$shape.json"
        run "bench-engine-$shape-serial" 120 "$bh" bench-engine --model "$m" \
          --backend cuda --batch 1,32,64 --no-compare --programmatic-launch off
      done
      ;;
    stream)
      # Weights streamed from host memory: the GPU tests that stream (every model case's tests
      # with every unit streamed, and streamed against resident bit for bit), then bench-engine
      # on both shapes with every weight resident and under device budgets (decode at 1 and 8
      # rows; the streamed GB/s beside 55 GB/s pinned host-to-device).
      run gpu-tests-streamed 300 "$bundle/gpu_tests" --gtest_filter='*streamed*:*Streamed*'
      m=$(model qwen2.5-7b)
      for budget in "" 12GiB 8GiB; do
        run "bench-engine-7b-budget-${budget:-none}" 200 "$bh" bench-engine --model "$m" \
          --backend cuda --batch 1,8 --steps 16 --prompt 32 --no-compare \
          ${budget:+--weight-budget $budget}
      done
      m=$(model qwen2.5-0.5b)
      for budget in "" 600MiB; do
        run "bench-engine-05b-budget-${budget:-none}" 120 "$bh" bench-engine --model "$m" \
          --backend cuda --batch 1,8 --steps 32 --prompt 32 --no-compare \
          ${budget:+--weight-budget $budget}
      done
      # Every fault class against a worker streaming part of its weights.
      run chaos-cuda-05b-streamed 240 "$bh" chaos --model "$m" --backend cuda --faults 30 \
        --seed 5 --worker-arg=--cuda-weight-budget=600MiB --report "$out/chaos-streamed.json"
      ;;
    times)
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        run "kernel-times-$shape" 200 "$bh" bench-engine --model "$m" --backend cuda \
          --batch 1,32 --steps 32 --kernel-times
      done
      ;;
    prefill-times)
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        run "kernel-times-prefill-$shape" 200 "$bh" bench-engine --model "$m" --backend cuda \
          --batch 1 --prompt 2048 --max-step-tokens 2048 --steps 4 --kernel-times --no-compare
      done
      ;;
    residual)
      run gpu-tests-residual 300 "$bundle/gpu_tests" \
        --gtest_filter='*ResidualEpilogue*:NormPartials*:NormedProduct*:ActivatedProduct*:*residual*:*normed*:*silu*:*fused*:*KernelTimes*'
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        run "kernel-times-$shape-residual" 150 "$bh" bench-engine --model "$m" --backend cuda \
          --batch 1,32 --steps 32 --kernel-times --no-compare --residual-in-products
        run "bench-engine-$shape-fused" 200 "$bh" bench-engine --model "$m" --backend cuda \
          --batch 1,8,32,64 --kernel-times --residual-in-products --norm-in-products \
          --silu-in-products
      done
      ;;
    fusions)
      # Captured steps (no kernel times) with each fusion of the small kernels into the products,
      # one at a time and together, against none, on one card.
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        for f in none residual residual,norm residual,norm,silu silu; do
          flags=()
          [[ $f == *residual* ]] && flags+=(--residual-in-products)
          [[ $f == *norm* ]] && flags+=(--norm-in-products)
          [[ $f == *silu* ]] && flags+=(--silu-in-products)
          run "bench-engine-$shape-fusions-${f//,/-}" 150 "$bh" bench-engine --model "$m" \
            --backend cuda --batch 1,8,32,64 --no-compare "${flags[@]}"
        done
      done
      ;;
    rope)
      run gpu-tests-rope 300 "$bundle/gpu_tests" --gtest_filter='*_rope*:Elementwise*'
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        for rope in off on; do
          run "bench-engine-$shape-rope-$rope" 150 "$bh" bench-engine --model "$m" --backend cuda \
            --batch 1,8,32,64 --no-compare --rope-in-attention $rope
        done
        run "kernel-times-$shape-rope" 150 "$bh" bench-engine --model "$m" --backend cuda \
          --batch 1,32 --steps 32 --kernel-times --no-compare --rope-in-attention on
      done
      ;;
    tiles)
      run gpu-tests-tiles 300 "$bundle/gpu_tests" --gtest_filter='*_tiles*:*LongContext*'
      m=$(model qwen2.5-7b)
      for tiles in off on; do
        run "bench-engine-qwen2.5-7b-long-tiles-$tiles" 200 "$bh" bench-engine --model "$m" \
          --backend cuda --batch 1 --prompt 8192 --steps 16 --no-compare --max-step-tokens 8192 \
          --attention-tiles $tiles
      done
      ;;
    schedules)
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        for schedule in plain pipelined two_tiles interleaved; do
          run "bench-engine-$shape-$schedule" 150 "$bh" bench-engine --model "$m" \
            --backend cuda --batch 1,8,32,64 --no-compare --gemm-schedules $schedule
        done
      done
      ;;
    prefill)
      run gemm-tests 200 "$bundle/gpu_tests" --gtest_filter='*Gemm*:*ProductFold*:TokenChecks*:*ResidualEpilogue*'
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        for last in pipelined plain interleaved tiled; do
          run "bench-engine-$shape-prefill-$last" 150 "$bh" bench-engine --model "$m" \
            --backend cuda --batch 1,8 --prompt 2048 --max-step-tokens 2048 --steps 8 --no-compare \
            --gemm-schedules pipelined,plain,plain,$last
        done
      done
      ;;
    tiled)
      run gemm-tests-tiled 300 "$bundle/gpu_tests" \
        --gtest_filter='*Gemm*:*ProductFold*:TokenChecks*:*ResidualEpilogue*:*ProductSchedules*'
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        for last in pipelined tiled; do
          run "bench-engine-$shape-decode-$last" 150 "$bh" bench-engine --model "$m" \
            --backend cuda --batch 33,48,64,96,128,256 --steps 32 --no-compare \
            --gemm-schedules pipelined,plain,plain,$last
          run "bench-engine-$shape-prefill-2048-$last" 150 "$bh" bench-engine --model "$m" \
            --backend cuda --batch 1 --prompt 2048 --max-step-tokens 2048 --steps 8 --no-compare \
            --gemm-schedules pipelined,plain,plain,$last
        done
      done
      ;;
    attention-probe)
      probe attention_mma_probe 120 -std=c++17 -gencode arch=compute_90,code=sm_90 -O3
      ;;
    cublas)
      run gpu-tests-cublas 300 "$bundle/gpu_tests" --gtest_filter='*cublas*:*MatmulGpuTest*'
      grep -E "FAILED|PASSED" "$out/gpu-tests-cublas.txt"
      m=$(model qwen2.5-7b)
      for products in on off; do
        run "bench-engine-qwen2.5-7b-cublas-$products" 200 "$bh" bench-engine --model "$m" \
          --backend cuda --batch 1,8,32,64 --cublas-products $products \
          --json "$out/bench-engine-qwen2.5-7b-cublas-$products.json"
      done
      ;;
    splits)
      # Split counts other than gemmSplits' for the small products, in whole steps (the one-row
      # choices are judged in bench-engine).
      optionVariants splits --gemm-splits 1,8,32 qwen2.5-0.5b \
        default 896x896=2,1152x896=2 896x896=4,1152x896=4 896x4864=8 896x4864=2 \
        896x896=4,1152x896=4,896x4864=8
      optionVariants splits --gemm-splits 1,8,32 qwen2.5-7b \
        default 4608x3584=1 37888x3584=2 3584x18944=8
      ;;
    shape-schedules)
      # Schedules per product shape at 33-95 rows (bench-gemm's fastest at 64 rows), in whole
      # steps.
      optionVariants schedules --gemm-shape-schedules 48,64 qwen2.5-7b \
        default 37888x3584=plain 4608x3584=two_tiles 152064x3584=plain \
        37888x3584=plain,4608x3584=two_tiles,152064x3584=plain
      optionVariants schedules --gemm-shape-schedules 48,64 qwen2.5-0.5b \
        default 1152x896=plain,896x896=plain,9728x896=two_tiles,151936x896=two_tiles
      ;;
    cublas-probe)
      probe cublas_probe 300 -std=c++17 -gencode arch=compute_90,code=sm_90 -O3 -lcublasLt -lcublas
      ;;
    persistent-probe)
      probe persistent_probe 240 -std=c++17 -gencode arch=compute_90,code=sm_90 -O3
      ;;
    wgmma-probe)
      probe mma_equality_probe 60 -std=c++20 -gencode arch=compute_90a,code=sm_90a -O2
      ;;
    context)
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        for prompt in 128 2048; do
          run "bench-engine-$shape-context-$prompt" 150 "$bh" bench-engine --model "$m" \
            --backend cuda --batch 1,8,32 --prompt $prompt --max-step-tokens 8192 --steps 32 \
            --no-compare
        done
      done
      run kernel-times-context-2048-qwen2.5-7b 150 "$bh" bench-engine --model "$m" \
        --backend cuda --batch 1 --prompt 2048 --max-step-tokens 2048 --steps 8 --kernel-times \
        --no-compare
      ;;
    attention-ncu)
      m=$(model qwen2.5-7b)
      # The fifth layer's attention; the first layer's gate/up (the third tiled launch).
      for kernel_skip in attentionTileKernel:4 tiledGemmKernel:2; do
        kernel=${kernel_skip%:*}
        run "ncu-prefill-$kernel" 280 ncu --clock-control none --set full -k "regex:$kernel" \
          --launch-skip "${kernel_skip#*:}" -c 1 --page details "$bh" bench-engine --model "$m" \
          --backend cuda \
          --batch 1 --prompt 2048 --max-step-tokens 2048 --steps 1 --no-compare --graphs off
      done
      ;;
    paired)
      run gemm-tests 200 "$bundle/gpu_tests" --gtest_filter='*Gemm*:*ProductFold*:*TokenChecks*'
      for shape in qwen2.5-7b qwen2.5-0.5b; do
        run "bench-gemm-$shape-32-64" 120 "$bh" bench-gemm --shape $shape --rows 32,64
      done
      "$0" "$bundle" "$out" paired-engine
      ;;
    paired-engine)
      # The default (paired where k is split and n <= k: the 7B's o and down, the 0.5B's down)
      # against those products pipelined, the rule before, at 33-64 rows.
      optionVariants paired --gemm-shape-schedules 40,48,64 qwen2.5-7b \
        default 3584x3584=pipelined,3584x18944=pipelined
      optionVariants paired --gemm-shape-schedules 40,48,64 qwen2.5-0.5b default 896x4864=pipelined
      ;;
    product-ncu)
      m=$(model qwen2.5-7b)
      # Demangled: gemmKernel<(int)8, (int)1, (bool)0, (int)2, ...>; the second launch of each
      # in the step (q/k/v then gate/up; o then down).
      for kernel in "gemmKernel<.int.8, .int.1, .bool.0, .int.2," \
        "gemmKernel<.int.8, .int.1, .bool.1, .int.1,"; do
        run "ncu-b64-${kernel//[^a-z0-9]/}" 200 ncu --clock-control none --set full \
          --kernel-name-base demangled -k "regex:$kernel" --launch-skip 1 -c 1 --page details \
          "$bh" bench-engine --model "$m" --backend cuda --batch 64 --steps 1 --no-compare \
          --graphs off
      done
      ;;
    timeline)
      lib=$(timelineLib)
      # The 0.5B at few rows first: where a launch-bound step's time goes between kernels.
      m=$(model qwen2.5-0.5b)
      run bench-engine-05b-timeline 120 env BULKHEAD_TIMELINE="$out/timeline-05b.csv" \
        LD_PRELOAD="$lib" "$bh" bench-engine --model "$m" --backend cuda --batch 1,8 --steps 32 \
        --no-compare
      run timeline-05b 60 python3 tools/gpu/timeline.py "$out/timeline-05b.csv"
      m=$(model qwen2.5-7b)
      for on in off on; do
        # The library in bench-engine alone: in any other process it would start the file again.
        run "bench-engine-7b-timeline-mma-$on" 150 env BULKHEAD_TIMELINE="$out/timeline-7b-mma-$on.csv" \
          LD_PRELOAD="$lib" "$bh" bench-engine --model "$m" --backend cuda --batch 1,64 --steps 32 \
          --no-compare --attention-mma $on
        run "timeline-7b-mma-$on" 60 python3 tools/gpu/timeline.py "$out/timeline-7b-mma-$on.csv"
      done
      ;;
    timeline-checks)
      # Steps of 1 and 32 rows of both shapes with the comparison runs (checks off, cuBLAS
      # products): each run's graph apart, so a kernel's time with and without its checks side
      # by side.
      lib=$(timelineLib)
      for shape in ${TIMELINE_SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do  # fewer, to fit a call
        m=$(model $shape)
        run "bench-engine-$shape-timeline-checks" 150 env \
          BULKHEAD_TIMELINE="$out/timeline-$shape-checks.csv" LD_PRELOAD="$lib" "$bh" bench-engine \
          --model "$m" --backend cuda --batch "${TIMELINE_BATCHES:-1,32}" --steps 32
        run "timeline-$shape-checks" 60 python3 tools/gpu/timeline.py \
          "$out/timeline-$shape-checks.csv" --by-grid
      done
      ;;
    paired-chunks)
      # Attention's chunks two at a time (head sizes up to 64: the 0.5B) against one at a time:
      # the long-context tests (the same rows), then bench-engine up to 8 and 64 rows paired.
      run gpu-tests-long-context 300 "$bundle/gpu_tests" --gtest_filter='*LongContext*'
      optionVariants paired-chunks --attention-paired-rows 1,8,32,64 qwen2.5-0.5b 0 8 64
      ;;
    ab) alternate "" --no-compare ;;
    ab-checks) alternate -checks ;;  # with the checks' and cuBLAS columns
    mma)
      run gpu-tests-mma 300 "$bundle/gpu_tests" --gtest_filter='*_mma*:*LongContext*:*TensorCores*'
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        for on in off on; do
          run "bench-engine-$shape-mma-$on" 150 "$bh" bench-engine --model "$m" --backend cuda \
            --batch 1,32,64 --no-compare --attention-mma $on
          run "bench-engine-$shape-mma-$on-2048" 150 "$bh" bench-engine --model "$m" \
            --backend cuda --batch 1,8,32 --prompt 2048 --max-step-tokens 8192 --steps 32 \
            --no-compare --attention-mma $on
          [ $shape = qwen2.5-7b ] && run "bench-engine-$shape-mma-$on-serial" 120 "$bh" \
            bench-engine --model "$m" --backend cuda --batch 1,64 --no-compare \
            --attention-mma $on --programmatic-launch off
        done
      done
      ;;
    logits)
      run gpu-tests-logits 300 "$bundle/gpu_tests" \
        --gtest_filter='*LogitsStoredByTheProduct*:*RowChecksAreThoseOfTheBytesWritten*:*Gemm*'
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        for on in on off; do
          run "bench-engine-$shape-logits-$on" 150 "$bh" bench-engine --model "$m" --backend cuda \
            --batch 1,8,32,64 --no-compare --logits-in-product $on
        done
      done
      ;;
    long)
      run gpu-tests-long 200 "$bundle/gpu_tests" --gtest_filter='*LongContext*'
      m=$(model qwen2.5-7b)
      run bench-engine-qwen2.5-7b-long 300 "$bh" bench-engine --model "$m" --backend cuda \
        --batch 1,8 --prompt 8192 --steps 32 --no-compare --max-step-tokens 8192
      ;;
    serve)
      for shape in qwen2.5-0.5b qwen2.5-7b; do
        m=$(model $shape)
        run "serve-bench-$shape" 300 "$bh" serve-bench --model "$m" --backend cuda \
          --concurrency 1,32,64 --json "$out/serve-bench-$shape.json"
        # Against bench-engine at the same batch, when the engine group ran on this host before.
        [ -f "$out/bench-engine-$shape.json" ] && [ -f tools/gpu/e2e-ratios.py ] &&
          python3 tools/gpu/e2e-ratios.py "$out/bench-engine-$shape.json" \
            "$out/serve-bench-$shape.json"
      done
      ;;
    cuda) "$0" "$bundle" "$out" tests engine serve ;;
    h200)  # the budget counts from this call's start
      PENDING_BUDGET_S=$((${PENDING_BUDGET_S:-570} - SECONDS)) "$0" "$bundle" "$out" cpu cpu engine \
        serve tests start
      ;;
    start)
      m=$(model qwen2.5-7b)
      rm -f /tmp/bulkhead-start.sock
      "$bundle/bulkhead-worker" --model "$m" --socket /tmp/bulkhead-start.sock --backend cuda \
        > "$out/worker-start-7b.txt" 2>&1 &
      pid=$!
      for _ in $(seq 1 240); do grep -q "serving on" "$out/worker-start-7b.txt" && break; sleep 0.5; done
      kill "$pid"
      wait "$pid"
      grep -E "loaded in|started in" "$out/worker-start-7b.txt"
      run chaos-cuda-7b 420 "$bh" chaos --model "$m" --backend cuda --faults 40 --seed 3 \
        --report "$out/chaos-cuda-7b.json"
      ;;
    *) echo "unknown group $group" >&2 ;;
  esac
  # Builds or options run in turn: their step times side by side.
  case $group in
    ab | ab-checks | paired | paired-engine | paired-chunks)
      python3 tools/gpu/ab-table.py "$out" ;;
  esac
done
