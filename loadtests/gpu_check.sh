#!/usr/bin/env bash
# The torch engine on a CUDA machine, in one run: where a turn's time goes (torch.profiler
# over an imported prefix and its decode steps, medium preset, bf16 and fp32:
# loadtests/engine_profile.py); its tests with CUDA as the engine's device (prefix import
# equals recompute, blocks moved between the GPU and the CPU, L1, KV codec, sampling), the
# vLLM connector's block moves between paged caches on the GPU
# (tests/unit/test_vllm_kv_blocks.py, no vLLM needed); then loadtests/engine_kv.py (KV
# reuse versus recompute, per turn, with the fetch-or-recompute decision as deployed) on
# the small preset in fp32 and the medium one (grouped-query attention, head_dim 128) in
# bf16, with SDPA's cuDNN backend off (the engine's choice) and on. Needs torch with CUDA,
# transformers, tokenizers, safetensors, xxhash, pydantic and pytest with pytest-asyncio;
# no Ray, Redis or network. Each step has its own time limit (a lease is short), most
# telling first; the whole ran in about 5 minutes on an H200.
#
#     OUT=/tmp/gpu-check bash loadtests/gpu_check.sh
#
# On a machine with no package registry, put the missing wheels in .whl/ (for the H200
# image: pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions,
# pytest, pluggy, iniconfig, pytest-asyncio) and the script installs them first; carry
# models/tiny to skip building it.
#
# Writes log.txt and one engine_kv_*.json per configuration under $OUT. The tests that need
# Ray Serve or Redis are not run here (CI runs the whole suite on CPU).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
say() { echo "[gpu-check] $*" | tee -a "$LOG"; }

if [ -d .whl ]; then  # wheels carried to a machine without a registry
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tee -a "$LOG"
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || { say "no CUDA device: nothing to check"; exit 2; }

status=0
step() {  # step <seconds> <label> <command...>: runs it under its limit, logs, keeps going
    local limit=$1 label=$2; shift 2
    say "$label"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    say "$label: rc $rc in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || status=1
}

for dtype in bfloat16 float32; do
    step "${PROFILE_TIMEOUT_S:-120}" "1/3 profile of an imported turn, medium $dtype" \
        python3 -m loadtests.engine_profile --preset medium --dtype "$dtype" --context 1024 --reply-tokens 32
done

step "${TEST_TIMEOUT_S:-200}" "2/3 engine tests, device cuda" \
    python3 -m pytest -q -p no:cacheprovider --noconftest \
    -p tests.fixtures.models -p tests.fixtures.engines \
    tests/integration/test_torch_engine_cuda.py tests/integration/test_torch_engine.py \
    tests/integration/test_torch_engine_kv.py tests/integration/test_torch_engine_l1.py \
    tests/unit/test_kv_codec.py tests/unit/test_prefix_cache.py tests/unit/test_sampling.py \
    tests/unit/test_vllm_kv_blocks.py \
    --deselect tests/unit/test_kv_codec.py::test_tier_bandwidth_is_bytes_over_seconds_of_the_averages
# (that one imports the data plane's connector, hence OpenTelemetry, which the machine lacks)

# preset, dtype, then further engine_kv arguments: bf16 with fewer, shorter turns (a lease
# is short), and once more with SDPA's cuDNN backend left on, the engine's default before
# 2026-12-04 (its per-shape graph builds made decode steps ~6x slower here).
for spec in "small float32 --rounds 1" "medium bfloat16 --rounds 1 --turns 4 --reply-tokens 40" \
            "medium bfloat16 --rounds 1 --turns 4 --reply-tokens 40 --cudnn-attention"; do
    set -- $spec
    preset=$1 dtype=$2; shift 2
    tag=$(echo "$preset $dtype $*" | tr -c 'a-z0-9\n' '_' | tr -s '_')
    step "${BENCH_TIMEOUT_S:-120}" "3/3 engine_kv preset=$preset dtype=$dtype $*" \
        python3 -m loadtests.engine_kv --preset "$preset" --dtype "$dtype" "$@" \
        --out "$OUT/engine_kv_${tag%_}.json"
done
say "done, status $status"
exit $status
