#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what is missing, builds the demo and runs it: the reference model generating with
# each cache, cached versus uncached timings and the equivalence check. Extra arguments go to
# the demo (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh g++ cmake make libeigen3-dev
cmake --preset demo >/dev/null
cmake --build --preset demo
./build/demo/examples/kvcache_demo "$@"
