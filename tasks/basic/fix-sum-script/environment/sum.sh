#!/bin/bash
# Sum the integers in a file, skipping blank lines and comments.
total=0
while read line; do
  if [ -z $line ] || [[ $line == "#"* ]]; then
    continue
  fi
  total=$total+$line
done < "$1"
echo $total
