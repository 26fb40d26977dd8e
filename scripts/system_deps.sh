#!/usr/bin/env bash
# Debian packages some tests use: Chromium (the HTML report is checked in a real headless
# browser), tmux (a job's console is read from a real terminal) and Slurm + munge (the sweep launcher is exercised on a one-node cluster).
# Needs root; skipped with a note otherwise. Idempotent.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v tmux >/dev/null 2>&1 || need+=(tmux)  # the console test runs a job in a real terminal
command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need+=(munge)
if [[ ${#need[@]} -eq 0 ]]; then exit 0; fi
if [[ $(id -u) -ne 0 ]]; then
  echo "[system_deps] not root: skipping apt-get install ${need[*]} (browser/Slurm tests will skip)" >&2
  exit 0
fi
echo "[system_deps] apt-get install ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
