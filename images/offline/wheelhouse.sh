#!/usr/bin/env bash
# Builds the wheelhouse an offline GPU machine or an air-gapped cluster node installs from.
# Run it on a machine with network access, in the repository root:
#
#   bash images/offline/wheelhouse.sh [DIR]         (default DIR: .whl)
#
# TARGET_PYTHON / TARGET_GLIBC describe the offline machine (defaults: 3.12 / 2.39, the CUDA
# images NVRx 0.7 ships wheels for). NVRx, defusedxml and crc32c come from here; torch and NVRx's
# other run-time requirements (grpcio, httpx, psutil, nvidia-ml-py, pyyaml, numpy, protobuf,
# safetensors) are expected from the CUDA image; NVRx's fastapi/uvicorn/pydantic requirements
# serve only its attribution services, which the trainer does not import, so the offline install
# skips dependency resolution (--no-deps).
set -euo pipefail
DIR=${1:-.whl}
PY=${TARGET_PYTHON:-3.12}
GLIBC=${TARGET_GLIBC:-2.39}
NVRX=${NVRX_VERSION:-0.7.0}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform "manylinux_${GLIBC/./_}_x86_64" --platform manylinux_2_17_x86_64 -d "$DIR" \
  "nvidia-resiliency-ext==$NVRX" defusedxml crc32c
python3 -m pip wheel -q --no-deps -w "$DIR" .
ls -1 "$DIR"
