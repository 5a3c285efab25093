#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
cd photos
for f in IMG_*.JPEG; do n=${f#IMG_}; n=${n%.JPEG}; mv "$f" "photo-$n.jpg"; done
