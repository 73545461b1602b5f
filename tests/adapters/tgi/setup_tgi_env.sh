#!/usr/bin/env bash
# Build a CPU virtual environment with TGI v3.3.7's Python server for tests/adapters/tgi.
#   bash tests/adapters/tgi/setup_tgi_env.sh TGI_CHECKOUT VENV
# TGI_CHECKOUT: TGI's public repository (huggingface/text-generation-inference) at tag v3.3.7,
# kept outside this repository. Pins come from TGI's server/uv.lock where newer releases break
# its imports (transformers 4.51.0, compressed-tensors 0.9.1, outlines 0.1.14, peft 0.14.0,
# accelerate 1.3.0). triton is only imported (models/metadata_kernels.py), never run on CPU.
set -euo pipefail
TGI=$(cd "$1" && pwd); VENV=$2
VATTN=$(cd "$(dirname "$0")/../../.." && pwd)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q "torch==2.13.0"
"$PIP" install -q "click<8.2.0" einops grpc-interceptor grpcio grpcio-reflection grpcio-status \
  grpcio-tools loguru "numpy<3" opentelemetry-api opentelemetry-exporter-otlp \
  opentelemetry-instrumentation-grpc pillow prometheus-client "protobuf>=5.28.3" py-cpuinfo rich \
  safetensors scipy sentencepiece tokenizers typer "transformers==4.51.0" "huggingface-hub<1" \
  kernels pydantic "outlines==0.1.14" pytest hypothesis psutil tqdm
"$PIP" install -q --no-deps "compressed-tensors==0.9.1" "peft==0.14.0" "accelerate==1.3.0" triton
# gRPC stubs, as server/Makefile's gen-server does
cd "$TGI/server"
mkdir -p text_generation_server/pb
"$VENV/bin/python" -m grpc_tools.protoc -I../proto/v3 --python_out=text_generation_server/pb \
  --grpc_python_out=text_generation_server/pb ../proto/v3/generate.proto
find text_generation_server/pb/ -type f -name "*.py" -exec sed -i -e 's/^\(import.*pb2\)/from . \1/g' {} \;
touch text_generation_server/pb/__init__.py
"$PIP" install -q --no-deps -e "$TGI/server"
"$PIP" install -q --no-deps -e "$VATTN"
"$VENV/bin/python" -m vattn.adapters.tgi check
