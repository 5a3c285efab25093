#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
sed -i 's/^DEBUG=.*/DEBUG=false/' .env
echo 'LOG_LEVEL=info' >> .env
