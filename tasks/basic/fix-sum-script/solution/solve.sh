#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
cat > sum.sh <<'EOF'
#!/bin/bash
# Sum the integers in a file, skipping blank lines and comments.
total=0
while IFS= read -r line || [ -n "$line" ]; do
  if [ -z "$line" ] || [[ $line == "#"* ]]; then
    continue
  fi
  total=$((total + line))
done < "$1"
echo "$total"
EOF
