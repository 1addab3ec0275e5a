#!/usr/bin/env bash
# The real clients tests/serve_clients.rs runs against `rloo serve`:
# Debian's Chromium with its WebDriver (chromedriver), and the openai
# package in a virtual environment at target/client-python. Prints the
# variable that points the tests at that Python, for
#   eval "$(scripts/serve/client_tools.sh)"
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver >&2
fi
if [ ! -x target/client-python/bin/python ]; then
  python3 -m venv target/client-python >&2
fi
target/client-python/bin/pip install -q -r scripts/serve/requirements.txt >&2
echo "export RLOO_TEST_PYTHON=$PWD/target/client-python/bin/python"
