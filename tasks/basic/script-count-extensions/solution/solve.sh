#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
cat > count_ext.sh <<'EOF'
#!/bin/bash
set -euo pipefail
find "$1" -type f -printf '%f\n' | while IFS= read -r name; do
  case "$name" in
    *.*) echo "${name##*.}" ;;
    *) echo none ;;
  esac
done | LC_ALL=C sort | uniq -c | awk '{print $2, $1}'
EOF
chmod +x count_ext.sh
