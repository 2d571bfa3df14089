#!/usr/bin/env bash
# Regenerates app/grpc_api/llm_pb2.py and llm_pb2_grpc.py from app/grpc_api/llm.proto.
# grpcio-tools is a build tool, not a dependency of the service: it goes into a
# virtualenv of its own (.venv-protoc), pinned to the grpcio and protobuf the service runs.
set -euo pipefail
cd "$(dirname "$0")/.."
GRPC_TOOLS_VERSION="${GRPC_TOOLS_VERSION:-1.85.1}"
if [ ! -x .venv-protoc/bin/python ]; then
  echo "[gen-grpc] creating .venv-protoc with grpcio-tools==${GRPC_TOOLS_VERSION}"
  python3 -m venv .venv-protoc
  .venv-protoc/bin/pip install -q "grpcio-tools==${GRPC_TOOLS_VERSION}"
fi
echo "[gen-grpc] app/grpc_api/llm.proto -> app/grpc_api/llm_pb2{,_grpc}.py"
.venv-protoc/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. app/grpc_api/llm.proto
# Generated code: not for linters.
for f in app/grpc_api/llm_pb2.py app/grpc_api/llm_pb2_grpc.py; do
  sed -i '1i # ruff: noqa' "$f"
done
