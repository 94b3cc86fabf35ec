#!/usr/bin/env bash
# scripts/step.sh LABEL COMMAND [ARG...]: one line on the screen for a long, quiet step of the Makefile's installs:
# "LABEL ..." at once, then "done (N s)" when COMMAND succeeds. COMMAND's own output goes to a log file, shown (its
# last 40 lines, and where the whole log is) only when it fails; its exit status is passed on.
set -u
if [ "$#" -lt 2 ]; then
    echo "usage: scripts/step.sh LABEL COMMAND [ARG...]" >&2
    exit 2
fi
label=$1
shift
log=$(mktemp "${TMPDIR:-/tmp}/grpo-step.XXXXXX")
SECONDS=0
printf '%s ...' "$label"
if "$@" >"$log" 2>&1; then
    printf ' done (%s s)\n' "$SECONDS"
    rm -f "$log"
else
    status=$?
    printf ' failed (exit status %s, after %s s); the last 40 lines of its output:\n' "$status" "$SECONDS"
    tail -n 40 "$log"
    printf '(all of it: %s)\n' "$log"
    exit "$status"
fi
