#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what is missing, builds everything (warnings as errors) and runs every test. The Redis
# block store's tests run against a server started here for them, where redis-server is installed
# (apt-get install redis-server; CI installs it), and stopped afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
source scripts/redis-for-tests.sh
kvcache_start_redis
cmake --workflow --preset release
