#!/usr/bin/env bash
# The torch engine on a CUDA machine, in one run: its tests (prefix import equals recompute,
# KV codec, sampling) with CUDA as the engine's device, the vLLM connector's block moves
# between paged caches on the GPU (tests/unit/test_vllm_kv_blocks.py, no vLLM needed), then loadtests/engine_kv.py (KV reuse
# versus recompute, per turn) on the small preset and on the medium one (grouped-query
# attention, head_dim 128) in fp32 and bf16. Needs torch with CUDA, transformers,
# tokenizers, safetensors, xxhash and pytest with pytest-asyncio; no Ray, Redis or network.
#
#     OUT=/tmp/gpu-check bash loadtests/gpu_check.sh
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
say "1/2 engine tests, device cuda"
timeout "${TEST_TIMEOUT_S:-240}" python3 -m pytest -q -p no:cacheprovider --noconftest \
    -p tests.fixtures.models -p tests.fixtures.engines \
    tests/integration/test_torch_engine.py tests/integration/test_torch_engine_kv.py \
    tests/unit/test_kv_codec.py tests/unit/test_prefix_cache.py tests/unit/test_sampling.py \
    tests/unit/test_vllm_kv_blocks.py 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

say "2/2 engine KV reuse versus recompute"
# preset, dtype, then further engine_kv arguments (bf16 with fewer, shorter turns: its
# decode steps ran ~10x slower than fp32's here, so the full shape outlasts the lease).
for spec in "small float32 --rounds 1" "medium float32 --rounds 1" "medium bfloat16 --rounds 1 --turns 4 --reply-tokens 40"; do
    set -- $spec
    preset=$1 dtype=$2; shift 2
    say "engine_kv preset=$preset dtype=$dtype $*"
    timeout "${BENCH_TIMEOUT_S:-150}" python3 -m loadtests.engine_kv --preset "$preset" --dtype "$dtype" "$@" \
        --out "$OUT/engine_kv_${preset}_${dtype}.json" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
say "done, status $status"
exit $status
