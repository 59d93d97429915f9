#!/usr/bin/env bash
# Runs a command with no network except loopback (docs/design.md §9), so nothing can quietly reach outside.
# Root uses a plain network namespace; others try an unprivileged user namespace; if neither is allowed the
# command runs as is, with a warning.
set -euo pipefail
if unshare -n true 2>/dev/null; then
  exec unshare -n sh -c 'ip link set lo up && exec "$0" "$@"' "$@"
elif unshare -rn true 2>/dev/null; then
  exec unshare -rn sh -c 'ip link set lo up && exec "$0" "$@"' "$@"
fi
echo "warning: cannot create a network namespace here; running with the normal network" >&2
exec "$@"
