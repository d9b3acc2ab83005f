#!/usr/bin/env bash
# Run a command as on a slower machine: this machine's CPUs capped to a share of their time
# (a CPU-time quota for a control group, cgroup v2 or v1) and, optionally, torch's kernels
# limited to one instruction set. #27's slower machine is the same 2-core kind at 2.0 GHz
# with AVX2 only; on a 2.6 GHz AVX-512 one:
#   sudo benchmarks/suite_cost/throttled.sh 0.77 avx2 make test
# The quota slows what computes by the clock ratio (2.0 / 2.6 = 0.77) and leaves what
# waits (sleeps, timeouts, gloo's waits) as it is, as a slower clock would; it is not a
# slower memory system, so it is an estimate of that machine, not a measurement of it.
# Needs root (it makes a control group). Prints the command's wall time at the end.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 SHARE CAPABILITY|native COMMAND..." >&2
  exit 2
fi
share=$1 capability=$2
shift 2
cores=$(nproc)
period=10000  # microseconds: short, so the cap throttles in small slices, not 100 ms stalls
quota=$(python3 -c "print(max(1000, int($share * $cores * $period)))")
name=shardwrap-throttled-$$
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then  # cgroup v2
  group=/sys/fs/cgroup/$name
  mkdir "$group"
  echo "$quota $period" > "$group/cpu.max"
else  # cgroup v1
  group=/sys/fs/cgroup/cpu/$name
  mkdir "$group"
  echo "$period" > "$group/cpu.cfs_period_us"
  echo "$quota" > "$group/cpu.cfs_quota_us"
fi
trap 'rmdir "$group" 2>/dev/null || true' EXIT
echo $$ > "$group/cgroup.procs"  # this shell, and so the command and all it starts
if [ "$capability" != native ]; then
  export ATEN_CPU_CAPABILITY=$capability
fi
echo "throttled: $share of $cores cores (quota $quota us per $period us), ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-native}" >&2
start=$(date +%s.%N)
status=0
"$@" || status=$?
echo "throttled wall time: $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s, exit $status" >&2
echo $$ > "$(dirname "$group")/cgroup.procs"  # out, so the group can go
exit $status
