#!/usr/bin/env bash
# Run a command as on an x86 CPU with AVX2 but without AVX-512 or native bfloat16 (the other kind
# of machine specrag runs on, where vLLM computes in float32), to measure that kind here:
#
#   scripts/emulate-avx2-only.sh .venv/bin/specrag serve ...
#
# What it changes, only for the command and its children:
# - /proc/cpuinfo, in a private mount namespace, without the avx512* and amx* flags: specrag's
#   `cpu_has_native_bf16` (so `auto` resolves to float32) and vLLM's platform checks read it;
# - torch's CPUID answers (scripts/avx2_only/sitecustomize.py): vLLM then loads its AVX2 kernel
#   library (`_C_AVX2`) and AVX2 attention paths, as on such a CPU;
# - the vector instruction sets of torch's own kernels, oneDNN and MKL, capped at AVX2.
# What it cannot change: the processor (its clock, caches, and AVX2 throughput). Needs root (the
# mount namespace). docs/vllm-cpu.md compares its figures with a real AVX2-only machine's.
set -euo pipefail
if [ "$#" -eq 0 ]; then
  echo "usage: $0 COMMAND [ARG...]" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
cpuinfo="$(mktemp)"
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*)//g' /proc/cpuinfo > "$cpuinfo"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export PYTHONPATH="$here/avx2_only${PYTHONPATH:+:$PYTHONPATH}"
exec unshare --mount --propagation private -- \
  sh -c 'mount --bind "$0" /proc/cpuinfo && rm -f "$0" && exec "$@"' "$cpuinfo" "$@"
