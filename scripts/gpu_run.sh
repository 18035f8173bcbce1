#!/usr/bin/env bash
# Runs on the lent H200 (its own python3 with torch; diffusers carried as a wheel in .whl/).
# Usage: WAMRT_GIT_SHA=<sha> bash scripts/gpu_run.sh PART[:SECONDS]...
#   parts: smoke edge nano tests load quant-edge quant-nano (lossy rows LOSSY_ROWS, default E6,E7,E8, + quality, the
#          quantization GPU tests and the fused fp8 activation kernel's)
#          vae (the policy's frame-0 VAE encode and the world decode, kernel option by kernel option: `wamrt bench
#          vae`, STAGES default encode,decode; then the GPU tests of both and of their per-pixel kernels)
#          dagger (issue 41: one DAgger round on the robot's clock, scripts/dagger_round.sh; carry .whl .gl;
#          ROUND_PHASE=record, then =train on the warm machine, splits a round over two calls)
#          host-timeline (a warm request's host work against its CUDA graphs: `wamrt bench host-timeline`)
#          ab-edge ab-nano (this tree against an older one carried in .ab-before/ -- `git archive <sha> src` unpacked, less src/wamrt/assets,
#          there, its sha in .ab-before/SHA -- in one process order per round, ROUNDS rounds alternating which side
#          goes first: `wamrt bench latency` with ROWS (E5) at 4 steps and LOSSY_ROWS (E7,E6); TRACE=1 traces this
#          tree's E7 in the last round). quant-* and ab-*: PACE_HZ=15 starts requests on a 15 Hz clock (--pace-hz).
#          fp8-engine-tests (a gen-fp8 engine's graph replay against its compiled self; the VAE encode's GPU tests and
#          its per-pixel kernels')
#          kernel-tests (the Triton kernels' GPU tests: q/k/v head epilogue, fp8 fusion)
#          decode (issue 42: `wamrt bench decode` at DECODE_SIZE, default nano, and the Reasoner's graph-vs-eager test)
#          world (issue 15: WorldEngine t2i / i2v vs diffusers; MODES, RUNS, PEER_RUNS, WORLD_MODEL, WORLD_ARGS)
#          world-rows (i2v: the last layer on the read rows against --all-rows, ROUNDS rounds, no peer)
#          world720 (issue 43: t2v 720x1280x189 with sound and a 480p x 93 edge transfer, per step vs diffusers;
#          LARGE_STEPS, LARGE_RUNS, PEER_STEPS, WORLD_ARGS; diffusers from .whl-bench, OpenCV is in the image)
#          world-tests (the WorldEngine GPU test), fa4-tests (flash-attn-4 against SDPA, in a graph)
#          world-parallel (issue 43: on an x2 / x4 / x8 machine, the world layouts' GPU test and `wamrt bench parallel
#          --world`: t2v 720p steps per second at 1-8 GPUs in the layouts cfg, ulysses, cfg+ulysses)
#          peer-edge peer-nano (issue 14: ROWS at 4 and 2 steps with the diffusers peer in the same process)
#          kernels (issue 14: `wamrt bench kernels --sweep` and the GPU tests of the epilogue GEMMs and the VAE encode)
#          grid (issue 41: the strategy x delay grid, `wamrt eval grid`, of panda-droid and the prefix-trained checkpoint
#          that prefix-train leaves at /tmp/wamrt-prefix/ckpt (or TRAINED=FOLDER); scripts/realtime_grid.sh, resumable, with
#          BUDGET_S 330 s of episodes: give it grid:560; carry .whl and .gl)
#          grid-wall (issue 41: the 15 Hz client on turntable against the prefix-trained checkpoint served at +560 ms,
#          prefix and async, 200 episodes each: ~4 min; same carry)
#          rows-edge rows-nano (E5 and its alternatives timed in one process; ROWS, default E5,E5-bucket,E5-bucket-mask
#          (issue 13: prompt buckets against exact lengths); E5-mask, E5-autotune on request -- autotuning can take
#          minutes at Nano, so give it a part of its own, e.g. rows-nano:560)
#          prefix-train (issue 41: panda-droid continued with random clean action prefixes on pick_place and the moving
#          task, demos recorded on the host cores while it trains, then synchronous pick_place on seeds 0-199 through
#          `wamrt serve`: scripts/prefix_train.sh, ~8 min, carry .whl and .gl; the checkpoint comes back as
#          $OUT/prefix-ckpt.tgz and stays at /tmp/wamrt-prefix/ckpt for later parts)
#          prefix-cost (issue 41: `wamrt bench prefix-cost` at Edge and Nano: a request without a prefix, with an
#          inpainted one and with RTC guidance, on the eager reference; PREFIX_COST_MODELS, WARMUP, RUNS)
#          lever-gates (issue 41: 2 steps, CFG on the first step, gen-fp8 gated against bf16 4 steps, each at its own d at
#          15 Hz: scripts/lever_gates.sh; SIZES, TASKS, LEVERS split the ~50 min of rollouts over calls)
# `load` also needs the server stack as wheels in .whl/ (starlette, uvicorn, websockets, python-multipart);
#   LOAD_REQUESTS (default 100) sizes each of its rows (1, 4, 8 lanes, mixed instructions).
# `load-plan` (issue 40; same wheels): `wamrt serve --model random:nano --gpu-memory 80` with no other tuning flag, lanes
#   cycling the `fleet` instructions (1-254 tokens), 1 / 4 / 8 lanes x LOAD_REQUESTS (100), after the engine row the
#   server is compared with (E5-serve, alone on the GPU first). Optional rows, a part each: `load-plan-edge24` (Edge bf16,
#   24 GiB), `load-plan-fp8-24` (Nano gen-fp8+reasoner-w8, 24 GiB), 1 and 4 lanes; `load-plan-i2v` (Nano, 80 GiB, an i2v
#   job beside 1 lane; needs PyAV). PLAN_MODEL / GPU_MEMORY / PLAN_LANES / PLAN_LATENCY / PLAN_SERVE_ARGS override them
#   (the CPU dry run: PLAN_MODEL=tiny-droid LATENCY_ARGS="--model tiny-qwen --tiny-vae --device cpu").
#   `graph-tests`: tests/engine/test_graph_memory_gpu.py (the shared pool against the allocator, background captures).
# `world-serve` (same wheels, plus PyAV for the MP4 replies): policy lanes with and without back-to-back i2v jobs
#   on the same server; ROW_SECONDS (default 50) per row, the whole part fits WORLD_SERVE_BUDGET (default 480 s);
#   STEP_SEGMENTS sets the server's --generation-step-segments (default 12).
# Latency rows warm up 10 requests (WARMUP; ../shared/docs/performance.md: at least 10) before RUNS timed ones.
# Each part is killed after SECONDS (default 540) and packed whatever it finished.
# Everything it measures is packed into $OUT/<part>.tgz (the device tool returns few files).
set -uo pipefail
cd "$(dirname "$0")/.."
# .whl (everything, 32 MB) or .whl-bench (diffusers, importlib_metadata and the server wheels, 7 MB: what the
# benches need, small enough to travel beside a flash-attn-4 part within a call's 64 MiB). Carry one of the two.
# .whl-av: PyAV, which the server's MP4 replies need (world-serve, load-plan-i2v); the image has none. Its wheel (36 MB)
# does not travel beside the tree and the server wheels; unpacked and packed as .whl-av/*.tar.xz it is 25 MB.
# .whl-extra: anything else one part needs.
wheels=$(ls .whl/*.whl .whl-bench/*.whl .whl-av/*.whl .whl-extra/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then  # none carried: a part that needs no extra package (kernel tests)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/wamrt-py/site-packages $wheels || exit 1
fi
for packed in .whl-av/*.tar.xz; do [ -f "$packed" ] && { mkdir -p /tmp/wamrt-py/site-packages; tar xJf "$packed" -C /tmp/wamrt-py/site-packages || exit 1; }; done
export PYTHONPATH=/tmp/wamrt-py/site-packages:$PWD/src PYTHONUNBUFFERED=1
# flash-attn-4 carried in parts (scripts/fa4_install.sh), in this call or staged by an earlier one on this machine
if compgen -G ".fa4*" >/dev/null || [ -d /tmp/wamrt-fa4 ]; then
  dsl=$(bash scripts/fa4_install.sh) && export PYTHONPATH=$PYTHONPATH:$dsl \
    && python3 -c 'import flash_attn.cute.interface; print("flash-attn-4 installed")' \
    || echo "flash-attn-4 not installed (parts staged so far: $(ls /tmp/wamrt-fa4 2>/dev/null | tr '\n' ' ')): fa4 stays off"
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
wamrt() { timeout "$limit" python3 -m wamrt.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader

# serve_plan LABEL MODEL GIB PORT LANES [serve flags...]: issue 40's rows. `wamrt serve` with the memory cap (and the
# given flags only), device memory sampled every 0.5 s, then `bench load --prompts fleet` rows at each lane count, each
# after the server's background captures are done (--graph-wait), the later ones against the 1-lane row. Writes
# $res/LABEL-LANES.json, LABEL-server.txt, -metrics.txt, -metadata.json, -readyz.json, -gpu-memory.csv.
serve_plan() {
  local label=$1 model=$2 gib=$3 port=$4 lanes=$5; shift 5
  local t_start; t_start=$(date +%s)
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 > "$res/$label-gpu-memory.csv" \
    2>/dev/null &
  local mem=$!
  python3 -m wamrt.cli serve --model "$model" --gpu-memory "$gib" --port "$port" "$@" > "$res/$label-server.txt" 2>&1 &
  local srv=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && break; kill -0 "$srv" 2>/dev/null || break
    grep -q "ERROR warm-up failed" "$res/$label-server.txt" && break; sleep 1
  done
  echo "$label: ready after $(( $(date +%s) - t_start )) s ($(grep -m1 'wamrt serve' "$res/$label-server.txt" \
    | cut -c1-300))" | tee -a "$res/log.txt"
  curl -s "http://127.0.0.1:$port/v1/metadata" > "$res/$label-metadata.json"
  for spec_n in $lanes; do  # N lanes, or N+gen: N lanes beside back-to-back GEN_FIELDS jobs (against N alone)
    if ! kill -0 "$srv" 2>/dev/null; then
      { echo "$label: the server exited; no rows (its last lines:)"; tail -3 "$res/$label-server.txt"; } \
        | tee -a "$res/log.txt"
      break
    fi
    local n=${spec_n%+gen} extra=() base=()
    if [ "$n" != "$spec_n" ]; then
      extra=(--background-generation "$GEN_FIELDS" --generation-warmup 0)
      [ -f "$res/$label-$n.json" ] && base=(--baseline "$res/$label-$n.json")
    elif [ "$n" != 1 ] && [ -f "$res/$label-1.json" ]; then
      base=(--baseline "$res/$label-1.json")
    fi
    local left=$(( limit - 45 - ($(date +%s) - t0) ))
    [ "$left" -lt 60 ] && { echo "$label: skipping $spec_n lanes: ${left} s left" | tee -a "$res/log.txt"; continue; }
    # the graph wait and the row share what is left; a row of ~100 Nano requests takes ~70 s
    timeout "$left" python3 -m wamrt.cli bench load --url "ws://127.0.0.1:$port" --lanes "$n" --prompts fleet \
      --requests "${LOAD_REQUESTS:-100}" --seconds "$(( left > 200 ? 150 : left - 50 ))" --graph-wait "$(( left - 60 ))" \
      --model "$label" "${base[@]}" "${extra[@]}" ${PLAN_LOAD_ARGS:-} --out "$res/$label-${spec_n/+/-}.json" 2>&1 \
      | tee -a "$res/log.txt"
  done
  curl -s "http://127.0.0.1:$port/readyz" > "$res/$label-readyz.json"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^wamrt_(graph|gpu|out_of|errors|generation)' > "$res/$label-metrics.txt"
  kill "$srv"; wait "$srv"; kill "$mem" 2>/dev/null
}

for spec in "$@"; do
  part=${spec%%:*}; limit=540; [ "$spec" != "$part" ] && limit=${spec#*:}
  res=/tmp/res-$part
  # a warm machine keeps /tmp between calls: an earlier call's rows must not travel in this part's archive
  rm -rf "$res"; mkdir -p "$res"
  t0=$(date +%s)
  # SM clock, power and clock-event reasons every 100 ms (summarised after the part: scripts/gpu_clocks.py)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active \
    --format=csv,noheader,nounits -lms 100 > "$res/gpu-clocks.csv" 2>/dev/null &
  sampler=$!
  case $part in
    smoke) wamrt bench latency --model edge --layers 2 --steps 2 --quick-warmup 1 --quick-runs 2 --warmup 1 --runs 2 \
             --peer diffusers --peer-warmup 1 --peer-runs 1 --out "$res" 2>&1 | tee "$res/log.txt" ;;
    edge|nano) wamrt bench latency --model "$part" --steps 4 2 --peer diffusers --trace --out "$res" 2>&1 \
             | tee "$res/log.txt" ;;
    quant-edge|quant-nano)
          # QUALITY=0: no quality record (SQNR table, chunk distances); QUANT_TESTS=0: no GPU tests after the rows;
          # EXACT_ROWS: the exact rows before them (default E5)
          quality=--quality; [ "${QUALITY:-1}" = 0 ] && quality=
          wamrt bench latency --model "${part#quant-}" --rows "${EXACT_ROWS:-E5}" --full-rows "${EXACT_ROWS:-E5}" --steps 4 --warmup "${WARMUP:-10}" --runs "${RUNS:-20}" \
             --lossy-rows "${LOSSY_ROWS:-E6,E7,E8}" $quality --trace ${TRACE_ROWS:+--trace-rows "$TRACE_ROWS"} ${PACE_HZ:+--pace-hz "$PACE_HZ"} \
             --out "$res" 2>&1 | tee "$res/log.txt"
          [ "${QUANT_TESTS:-1}" = 0 ] || timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/quant tests/engine/test_fp8_fusion.py 2>&1 \
             | tail -30 | tee -a "$res/log.txt" ;;
    rows-edge|rows-nano)
          wamrt bench latency --model "${part#rows-}" --rows "${ROWS:-E5,E5-bucket,E5-bucket-mask}" \
             --full-rows "${ROWS:-E5,E5-bucket,E5-bucket-mask}" --steps 4 ${TRACE_ROWS:+--trace --trace-rows "$TRACE_ROWS"} \
             --warmup "${WARMUP:-10}" --runs "${RUNS:-20}" --out "$res" 2>&1 | tee "$res/log.txt" ;;
    peer-edge|peer-nano) # Issue 14: ROWS (default E5,E5-quack) at 4 and 2 steps beside the diffusers peer, one process
          wamrt bench latency --model "${part#peer-}" --rows "${ROWS:-E5,E5-quack}" --full-rows "${ROWS:-E5,E5-quack}" \
             --other-steps-rows "${ROWS:-E5,E5-quack}" --steps 4 2 --peer diffusers --peer-warmup 2 --peer-runs "${PEER_RUNS:-8}" \
             --warmup "${WARMUP:-10}" --runs "${RUNS:-20}" ${TRACE_ROWS:+--trace --trace-rows "$TRACE_ROWS"} \
             --out "$res" 2>&1 | tee "$res/log.txt" ;;
    load) # Issue 13: lanes cycle through twelve instructions of 118-152 tokens (`--prompts mixed`, variable-length
          # tokenizer of random:nano); every prefix is padded to the declared width 192 (3 x 64-token buckets),
          # so warm-up's captures (batch 8..1 at width 192) serve every mix: graph_captures_after_warmup must be 0.
          # SERVE_ARGS: more server flags (e.g. --attention fa4 --epilogues quack); LOAD_LANES: the rows (default 1 4 8)
          python3 -m wamrt.cli serve --model random:nano --max-batch 8 --max-wait-ms 10 --max-queue 64 \
             --prompt-bucket 64 --prompt-width 192 --warmup 1 --port 8765 ${SERVE_ARGS:-} > "$res/server.txt" 2>&1 &
          srv=$!
          for _ in $(seq 1 150); do curl -sf http://127.0.0.1:8765/readyz >/dev/null && break; sleep 2; done
          echo "server ready after $(( $(date +%s) - t0 )) s" | tee "$res/log.txt"
          for lanes in ${LOAD_LANES:-1 4 8}; do
            base=(); [ "$lanes" != 1 ] && base=(--baseline "$res/nano-load-1.json")
            # ~100 requests at ~1.45 req/s is ~70 s. Cap each row (measured time; its lanes' warm-up and the 60 s of
            # slack come on top) by what is left of the part's limit.
            left=$(( limit - 60 - ($(date +%s) - t0) )); cap=$(( left < 140 ? left : 140 ))
            [ "$cap" -lt 30 ] && { echo "skipping $lanes lanes: ${left} s left" | tee -a "$res/log.txt"; continue; }
            timeout $(( cap + 60 )) python3 -m wamrt.cli bench load --url ws://127.0.0.1:8765 --lanes "$lanes" \
              --prompts mixed --requests "${LOAD_REQUESTS:-100}" --seconds "$cap" --model nano "${base[@]}" \
              --out "$res/nano-load-$lanes.json" 2>&1 | tee -a "$res/log.txt"
          done
          curl -s http://127.0.0.1:8765/metrics | grep '^wamrt_graph' > "$res/graph-metrics.txt"
          kill "$srv"; wait "$srv" ;;
    load-plan|load-plan-edge24|load-plan-fp8-24)
          # Issue 40. load-plan: first the engine row the server is compared with (E5-serve: its engine config at 4
          # steps, cuDNN attention as on a machine without flash-attn-4), alone on the GPU; its compiled kernels stay
          # in Inductor's cache for the server's batch-1 shapes. Then the server, no tuning flag but the cap.
          case $part in
            load-plan) label=nano80; model=${PLAN_MODEL:-random:nano}; gib=${GPU_MEMORY:-80}; lanes=${PLAN_LANES:-1 4 8}
                       latency=${PLAN_LATENCY:-1} ;;
            load-plan-edge24) label=edge24; model=${PLAN_MODEL:-random:edge}; gib=${GPU_MEMORY:-24}
                              lanes=${PLAN_LANES:-1 4}; latency=${PLAN_LATENCY:-0} ;;
            load-plan-fp8-24) label=nanofp8-24; model=${PLAN_MODEL:-random:nano@gen-fp8+reasoner-w8}
                              gib=${GPU_MEMORY:-24}; lanes=${PLAN_LANES:-1 4}; latency=${PLAN_LATENCY:-0} ;;
          esac
          if [ "$latency" = 1 ]; then
            timeout 200 python3 -m wamrt.cli bench latency ${LATENCY_ARGS:---model nano} --rows E5-serve \
              --full-rows E5-serve --steps 4 --warmup "${WARMUP:-10}" --runs "${RUNS:-20}" --out "$res/latency" 2>&1 \
              | grep -v 'UserWarning\|exe_args' | tee -a "$res/log.txt"
          fi
          serve_plan "$label" "$model" "$gib" 8767 "$lanes" ${PLAN_SERVE_ARGS:-}
          python3 -m wamrt.bench.load_plan "$res" 2>&1 | tee -a "$res/log.txt" ;;
    load-plan-i2v) # Issue 40: the 80 GiB server with an i2v job (480x832, 33 frames, 35 steps) beside 1 lane; the job
          # size is a flag (the plan's own default leaves generation less than that job's worst-shape estimate).
          GEN_FIELDS=${GEN_FIELDS:-'{"prompt": "A robot arm picks up the red block and places it in the blue bowl.",
            "size": "832x480", "num_frames": "33", "num_inference_steps": "35", "guidance_scale": "6", "seed": "0",
            "input_reference": "@sample"}'}
          # row 1: one lane alone; row 1+gen: the same lane beside the jobs (p99 against row 1's). The lane asks once
          # per 1,067 ms (LANE_PERIOD_MS), a robot at 15 Hz asking for its next 32-step chunk halfway through the
          # current one: back to back, a lane keeps the device busy and the jobs get ~2 % of it (policy first, by
          # design), so none finishes in a row (H100, f4a6b88).
          PLAN_LOAD_ARGS="--lane-period-ms ${LANE_PERIOD_MS:-1067} ${PLAN_LOAD_ARGS:-}" \
            serve_plan nano80-i2v "${PLAN_MODEL:-random:nano}" "${GPU_MEMORY:-80}" 8768 "${PLAN_LANES:-1 1+gen}" \
            --max-video-pixels "${VIDEO_PIXELS:-13178880}" --generation-warmup "$GEN_FIELDS" ${PLAN_SERVE_ARGS:-}
          python3 -m wamrt.bench.load_plan "$res" 2>&1 | tee -a "$res/log.txt" ;;
    world-serve) # Policy latency while world generation runs on the same server (docs/serving.md, "Scheduling"):
          # row A: 1 lane, mixed instructions, no generation; row B: the same while image -> video jobs (480x832,
          # 33 frames, 35 steps, guidance 6: `world`'s i2v row) run back to back on /v1/videos/sync; row D: 4 lanes,
          # no generation; row C: 4 lanes with the same jobs. B carries --baseline A, C --baseline D (p50 / p99
          # ratios at the same lane count). Server as in `load` (random:nano, prompt buckets, width 192), but
          # --max-batch 4, the most lanes here: warm-up captures 4 batch sizes, not 8; each denoising step of a
          # job is captured as --generation-step-segments (default 12) graphs, so a policy request waits for ~1/12
          # of a step. Time, for a part meant to fit in WORLD_SERVE_BUDGET = 480 s: model build + warm-up ~65 s;
          # A = the lanes' warm-up (~10 s) + ROW_SECONDS (50); B = one job alone first (the WorldEngine compiles
          # and captures the i2v bucket, ~15 s, then ~7.5 s to run) + 60 s; D and C ~60 s each: ~65 + 60 + 85 +
          # 60 + 60 = 330 s, + 15 s to stop and pack. Each row gets at most what is left split over the rows still
          # to run (minus 30 s of warm-ups), so a slow start shortens rows rather than losing the last.
          # Under 4 lanes generation gets little (policy first, by design); background_generation.device_share
          # says what it got.
          budget=${WORLD_SERVE_BUDGET:-480}; [ "$limit" -lt "$budget" ] && budget=$limit
          python3 -c 'import av, PIL' 2>/dev/null \
            || echo "PyAV / Pillow missing: the server cannot encode the MP4 replies, rows B and C will fail" \
            | tee -a "$res/log.txt"
          python3 -m wamrt.cli serve --model random:nano --max-batch 4 --max-wait-ms 10 --max-queue 64 \
             --prompt-bucket 64 --prompt-width 192 --warmup 1 --port 8766 \
             --generation-step-segments "${STEP_SEGMENTS:-12}" > "$res/server.txt" 2>&1 &
          srv=$!
          for _ in $(seq 1 100); do
            curl -sf http://127.0.0.1:8766/readyz >/dev/null && break; kill -0 "$srv" 2>/dev/null || break; sleep 2
          done
          echo "server ready after $(( $(date +%s) - t0 )) s" | tee -a "$res/log.txt"
          gen='{"prompt": "A robot arm picks up the red block and places it in the blue bowl.", "size": "832x480",
                "num_frames": "33", "num_inference_steps": "35", "guidance_scale": "6", "seed": "0",
                "input_reference": "@sample"}'
          rows=(A B D C)
          for i in 0 1 2 3; do
            row=${rows[$i]}
            left=$(( budget - 15 - ($(date +%s) - t0) ))
            cap=$(( left / (4 - i) - 30 )); [ "$cap" -gt "${ROW_SECONDS:-50}" ] && cap=${ROW_SECONDS:-50}
            [ "$cap" -lt 20 ] && { echo "skipping row $row: ${left} s left" | tee -a "$res/log.txt"; continue; }
            extra=()
            case $row in
              A) extra=(--lanes 1) ;;
              B) [ -f "$res/world-serve-A.json" ] && extra=(--baseline "$res/world-serve-A.json")
                 extra+=(--lanes 1 --background-generation "$gen") ;;
              D) extra=(--lanes 4) ;;
              C) warm=1; [ -f "$res/world-serve-B.json" ] && warm=0  # B compiled and captured the job's bucket
                 [ -f "$res/world-serve-D.json" ] && extra=(--baseline "$res/world-serve-D.json")
                 extra+=(--lanes 4 --background-generation "$gen" --generation-warmup "$warm") ;;
            esac
            echo "row $row: ${cap} s" | tee -a "$res/log.txt"
            # + 120 s: the lanes' warm-up and B's job alone (its first-job compile may take longer than bench world's)
            timeout $(( cap + 120 )) python3 -m wamrt.cli bench load --url ws://127.0.0.1:8766 --prompts mixed \
              --seconds "$cap" --model nano "${extra[@]}" --out "$res/world-serve-$row.json" 2>&1 | tee -a "$res/log.txt"
          done
          curl -s http://127.0.0.1:8766/metrics | grep -E '^wamrt_(graph|generation)' > "$res/metrics.txt"
          kill "$srv"; wait "$srv"
          python3 -c 'import json, os, sys
rows = {r: json.load(open(p)) for r in "ABDC" for p in [sys.argv[1] + "/world-serve-" + r + ".json"] if os.path.exists(p)}
ms = lambda v: "-" if v is None else "%.0f" % v
lat = ["%s %s/%s" % (r, ms(d["p50_ms"]), ms(d["p99_ms"])) for r, d in rows.items()]
gen = ["%s %s (device share %s, longest segment %s ms, %s failed)" % (r, g["jobs_completed"], g["device_share"],
       ms(g["segment_max_ms"]), g["jobs_failed"]) for r, d in rows.items() for g in [d.get("background_generation")] if g]
print("world-serve: policy p50/p99 ms " + " | ".join(lat) + "; generation jobs done " + ("; ".join(gen) or "-"))' \
            "$res" 2>&1 | tee -a "$res/log.txt" ;;
    x2) # nvidia-h200-x2 (issue 8). Multicast stays off in every process (the bench/test set it again).
        export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
        budget=${X2_BUDGET:-570}
        { python3 -c 'import torch; print("cuda devices:", torch.cuda.device_count(), torch.__version__)'
          nvidia-smi topo -m; } 2>&1 | tee "$res/log.txt"
        # 1. Nano: single-GPU E5 then --parallel cfg E5, same process, same weights (ratio in the cfg JSON).
        timeout 230 python3 -m wamrt.cli bench parallel --model nano --parallel cfg --gpus 2 --baseline --steps 4 \
          --warmup 10 --runs 25 --out "$res" 2>&1 | tee -a "$res/log.txt"
        # 2. CFG-parallel vs single GPU within bf16 tolerance (Nano widths, 4 layers, E5 on both).
        timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/parallel/test_parallel_gpu.py 2>&1 \
          | tee -a "$res/log.txt"
        # 3. Super --parallel tp (each rank builds only its shard): engine p50, ratio to (bf16 floor / 2), and
        #    the same engine behind a loopback server (one websocket lane; needs the server wheels in .whl/).
        left=$(( budget - ($(date +%s) - t0) ))
        echo "super tp gets ${left} s" | tee -a "$res/log.txt"
        timeout "$left" python3 -m wamrt.cli bench parallel --model super --parallel tp --gpus 2 --steps 4 \
          --warmup 5 --runs 20 --serve-seconds 20 --out "$res" 2>&1 | tee -a "$res/log.txt" ;;
    world-parallel) # Issue 43 item 4, on nvidia-h200-x2 / x4 / x8: the world layouts' GPU test (2 GPUs), then t2v
          # 1280x720 x 189 frames denoising steps per second at GPU_COUNTS (default 1 and each power of 2 up to the
          # visible GPUs) in the layouts cfg, ulysses, cfg+ulysses (`wamrt bench parallel --world`, Nano random
          # weights, STEPS steps per request, RUNS timed requests per layout); WORLD_PARALLEL_ARGS: more flags;
          # WORLD_TESTS=0: no GPU test (a later call of a run split over several).
          export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
          gpus=$(nvidia-smi -L | wc -l); counts=1; for n in 2 4 8; do [ "$n" -le "$gpus" ] && counts=$counts,$n; done
          [ "${WORLD_TESTS:-1}" = 0 ] || timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -s \
             tests/parallel/test_parallel_gpu.py -k world 2>&1 | tee "$res/log.txt"
          wamrt bench parallel --world --model "${WORLD_MODEL:-nano}" --gpu-counts "${GPU_COUNTS:-$counts}" \
             --steps "${STEPS:-4}" --world-runs "${RUNS:-2}" ${WORLD_PARALLEL_ARGS:-} --out "$res" 2>&1 \
             | tee -a "$res/log.txt" ;;
    world) # Issue 15: t2i 1024x1024 and i2v 480x832x33, 35 steps, guidance 6, WorldEngine vs diffusers' pipeline.
          wamrt bench world --model "${WORLD_MODEL:-nano}" --modes "${MODES:-t2i,i2v}" --warmup "${WARMUP:-1}" \
             --runs "${RUNS:-5}" --peer diffusers --peer-warmup 1 --peer-runs "${PEER_RUNS:-5}" ${WORLD_ARGS:-} \
             --out "$res" 2>&1 | tee "$res/log.txt" ;;
    world720) # Issue 43: the peers' workload on random Nano weights with sound heads, one process: t2v 720x1280,
          # 189 frames, guidance 6, shift 10, with sound; a 480x832 x 93-frame edge transfer (guidance 3, control
          # guidance 1.5). Both sides run few steps, compared per step (a 720p step is ~5.7 s, ~44k tokens a branch):
          # ours 1 warm-up (compile + capture) + LARGE_RUNS timed requests of LARGE_STEPS steps, the peer PEER_STEPS
          # steps; then one profiled request (attention's share) and the clip's VAE decode alone. Estimate at the
          # defaults (4 / 2 / 3): build ~30 s; t2v720 peer ~30 s, ours ~100 s warm-up + ~65 s timed + ~25 s profile
          # + ~15 s decode; transfer ~10 s peer, ~110 s warm-up (two shapes to compile), ~30 s timed, ~15 s rest:
          # ~430 s, inside the 540 s default limit.
          wamrt bench world --model "${WORLD_MODEL:-nano}" --modes "${MODES:-t2v720,transfer}" \
             --large-steps "${LARGE_STEPS:-4}" --large-runs "${LARGE_RUNS:-2}" --peer-steps "${PEER_STEPS:-3}" \
             --peer diffusers ${WORLD_ARGS:-} --out "$res" 2>&1 | tee "$res/log.txt" ;;
    world-rows) # i2v with the last layer on the rows whose output is read (the default: not the conditioning frame)
          # against --all-rows, one process each, ROUNDS (2) rounds alternating which goes first; no peer.
          # WORLD_ARGS: more flags for both (e.g. --epilogues quack)
          limit=$(( limit / (2 * ${ROUNDS:-2}) ))  # each process its share of the part's seconds
          for round in $(seq "${ROUNDS:-2}"); do
            order="read all"; [ $((round % 2)) = 0 ] && order="all read"
            for side in $order; do
              flag=; [ "$side" = all ] && flag=--all-rows
              mkdir -p "$res/round$round-$side"
              wamrt bench world --model "${WORLD_MODEL:-nano}" --modes i2v --warmup "${WARMUP:-1}" --runs "${RUNS:-5}" \
                 --peer none $flag ${WORLD_ARGS:-} --out "$res/round$round-$side" 2>&1 | tee -a "$res/log.txt"
            done
          done ;;
    fa4-tests) timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/engine/test_fa4_gpu.py \
             2>&1 | tee "$res/log.txt"
          timeout 120 python3 -c 'import torch; from wamrt.ops.attention import measure_backends as m
for sq, sk in ((3092, 3220), (3510, 3638), (1024, 1152)):
    print(sq, sk, m((2, 32, sq, 128), 32, sk, dtype=torch.bfloat16, device=torch.device("cuda")))' 2>&1 \
             | tee -a "$res/log.txt" ;;
    kernels) # Issue 14: GEMM call sites, cuBLAS + Inductor vs quack's fused epilogues (tile sweep), then the GPU tests
          # of the new kernels (epilogues, first-frame VAE encode).
          wamrt bench kernels --sweep --out "$res" 2>&1 | tee "$res/log.txt"
          timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/engine/test_epilogues.py \
             tests/engine/test_vae_encode.py 2>&1 | tail -20 | tee -a "$res/log.txt" ;;
    world-tests) timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/engine/test_world_engine_gpu.py tests/engine/test_vae_decode.py \
             2>&1 | tee "$res/log.txt" ;;
    graph-tests) # Issue 40: one pool near the largest graph, /metrics = the allocator, background captures under load
          timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/engine/test_graph_memory_gpu.py \
             2>&1 | tee "$res/log.txt" ;;
    tests) timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/engine/test_engine_gpu.py tests/engine/test_bucket_attention.py tests/sampler 2>&1 \
             | tee "$res/log.txt" ;;
    host-timeline) # A warm request's host marks against its CUDA graphs, and a cProfile of them (`wamrt bench
          # host-timeline`); MODEL (edge), ROW (E7), ATTENTION (default fa4 where installed), ENGINE_FLAGS (JSON)
          wamrt bench host-timeline --model "${MODEL:-edge}" --row "${ROW:-E7}" ${ATTENTION:+--attention "$ATTENTION"} \
             --engine-flags "${ENGINE_FLAGS:-{\}}" --out "$res" 2>&1 | tee "$res/log.txt" ;;
    vae) # The policy's frame-0 VAE encode and the world decode at the i2v shape, option by option (`wamrt bench vae`;
          # ~2 min), then the GPU tests of both and of their per-pixel kernels
          wamrt bench vae --stages "${STAGES:-encode,decode}" --out "$res" 2>&1 | tee "$res/log.txt"
          timeout 240 python3 -m pytest -v -p no:cacheprovider -m gpu -s tests/engine/test_vae_encode.py \
             tests/engine/test_vae_decode.py tests/ops/test_channels_last.py 2>&1 | tee "$res/gpu-tests.txt" | tail -8 \
             | tee -a "$res/log.txt" ;;
    ab-edge|ab-nano) # Issue 14: before / after in one lease (see the usage above)
          before=$(cat .ab-before/SHA)  # carried without its assets (the embedded default model): this tree's
          [ -e .ab-before/src/wamrt/assets ] || ln -s "$PWD/src/wamrt/assets" .ab-before/src/wamrt/assets
          for round in $(seq "${ROUNDS:-2}"); do
            sides="before after"; [ $((round % 2)) = 0 ] && sides="after before"
            for side in $sides; do
              src=$PWD/src; sha=$WAMRT_GIT_SHA; [ "$side" = before ] && src=$PWD/.ab-before/src && sha=$before
              each=$(( limit / (2 * ${ROUNDS:-2}) )); trace=; [ "${TRACE:-1}" = 1 ] && [ "$side" = after ] && [ "$round" = "${ROUNDS:-2}" ] && trace="--trace --trace-rows E7"
              echo "== round $round, $side ($sha)"
              PYTHONPATH=${PYTHONPATH/$PWD\/src/$src} WAMRT_GIT_SHA=$sha timeout "$each" python3 -m wamrt.cli bench latency \
                 --model "${part#ab-}" --rows "${ROWS:-E5}" --steps 4 --lossy-rows "${LOSSY_ROWS:-E7,E6}" $trace ${PACE_HZ:+--pace-hz "$PACE_HZ"} \
                 --warmup "${WARMUP:-10}" --runs "${RUNS:-30}" --out "$res/round$round-$side" 2>&1 | grep -v 'UserWarning\|exe_args' \
                 | tee -a "$res/log.txt"
            done
          done ;;
    fp8-engine-tests) # a gen-fp8 engine's graph replay at the default fast accumulation; the VAE encode's GPU tests
          timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/engine/test_vae_encode.py \
             tests/ops/test_channels_last.py \
             tests/engine/test_fp8_fusion.py::test_gen_fp8_engine_replays_its_compiled_self_with_fast_accumulation \
             2>&1 | tee "$res/log.txt" ;;
    decode) # Issue 42: the Reasoner's text decode at DECODE_SIZE (default nano), random weights: prefill tokens/s,
          # batch 1 (eager and CUDA-graph steps) / 8 / 32 decode tokens/s against the HBM floor, unfused and with the
          # layers' small kernels compiled (reasoner/fused.py), transformers' generate on the same weights as the
          # baseline, then the fused layers again on one matrix for q/k/v and one for gate/up (engine/fuse.py
          # fuse_reasoner), and at batch 1 in the compile modes FUSED_MODES (e.g. "max-autotune-no-cudagraphs
          # coordinate-descent"); then the graph-vs-eager GPU tests. 129 s at Nano with the fused rows (36131c6,
          # H100); give it decode:300, decode:540 with FUSED_MODES.
          wamrt bench decode --size "${DECODE_SIZE:-nano}" --prompt-tokens "${PROMPT_TOKENS:-512}" \
             --new-tokens "${NEW_TOKENS:-128}" --hf-tokens "${HF_TOKENS:-64}" ${FUSED_MODES:+--fused-modes $FUSED_MODES} \
             --profile-steps "${PROFILE_STEPS:-20}" ${DECODE_ARGS:-} \
             --out "$res" 2>&1 | tee "$res/log.txt"
          # DECODE_TESTS: the GPU test files to run after it (default all four; 0: none)
          tests=${DECODE_TESTS:-tests/reasoner/test_reasoner_gpu.py tests/ops/test_decode_attention.py tests/ops/test_gemv.py tests/ops/test_gemv_fused.py}
          # shellcheck disable=SC2086
          [ "$tests" = 0 ] || timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu -s $tests 2>&1 | tail -80 \
             | tee -a "$res/log.txt" ;;
    prefix-cost) # Issue 41: what a prefix request costs on the eager reference (none / inpaint / guided RTC), Edge at
          # its d = 3 and Nano at its d = 10 (and each at the other's), random weights; give it prefix-cost:420
          for size in ${PREFIX_COST_MODELS:-edge nano}; do
            wamrt bench prefix-cost --model "$size" --delays 3 10 --warmup "${WARMUP:-3}" --runs "${RUNS:-10}" \
               --out "$res" 2>&1 | grep -v 'UserWarning' | tee -a "$res/log.txt"
          done ;;
    prefix-train) # Issue 41: training-time RTC fine-tune of panda-droid + its synchronous pick_place evaluation
          RES=$res timeout "$limit" bash scripts/prefix_train.sh 2>&1 | tee "$res/log.txt" ;;
    dagger) # Issue 41: a DAgger round on the robot's clock (scripts/dagger_round.sh); give it dagger:580
          RES=$res timeout "$limit" bash scripts/dagger_round.sh 2>&1 | tee "$res/log.txt" ;;
    lever-gates) # Issue 41: the lossy levers at each configuration's own delay (needs the delay mode of eval gate)
          RES=$res timeout "$limit" bash scripts/lever_gates.sh 2>&1 | tee "$res/log.txt" ;;
    grid) # Issue 41: success against delay per strategy (the checkpoint for prefix-trained: TRAINED, default prefix-train's)
          GRID_LIMIT_S=$limit RES=$res timeout "$limit" bash scripts/realtime_grid.sh ${TRAINED:+"$TRAINED"} 2>&1 \
            | tee "$res/log.txt"
          # Killed at the limit: the cells finished so far (each written as it completes) still come back.
          pkill -f "wamrt.cli eval grid" 2>/dev/null
          for done_dir in "${GRID_DIR:-/tmp/wamrt-grid}"/*/; do
            [ -d "$res/grid/$(basename "$done_dir")" ] || { mkdir -p "$res/grid-unfinished" && cp -r "$done_dir" "$res/grid-unfinished/"; }
          done ;;
    grid-wall) # Issue 41: the 15 Hz client against a server answering at ~600 ms (compare with the grid's d = 10 cells)
          GRID=0 WALL=1 RES=$res timeout "$limit" bash scripts/realtime_grid.sh ${TRAINED:+"$TRAINED"} 2>&1 \
             | tee "$res/log.txt" ;;
    kernel-tests) # the Triton kernels against their references (head epilogue, fp8 fusion), in graphs, timed
          timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/engine/test_qkv_epilogue.py \
             tests/engine/test_fp8_fusion.py tests/ops/test_quantized_attention.py tests/ops/test_fp8_gemm.py 2>&1 \
             | tee "$res/log.txt" ;;
  esac
  kill "$sampler" 2>/dev/null
  python3 scripts/gpu_clocks.py "$res/gpu-clocks.csv" --rows $(find "$res" -name '*.json' ! -name 'trace-*') \
    | tee -a "$res/log.txt"
  gzip -9f "$res/gpu-clocks.csv"  # raw samples compress ~10x: committed result folders stay small enough to carry
  echo "part $part took $(( $(date +%s) - t0 )) s"
  tar czf "$OUT/$part.tgz" -C "$res" .
done
