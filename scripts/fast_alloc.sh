# Source this (`. scripts/fast_alloc.sh`) before CPU training (`cepe train`), `cepe fit-heads` or `cepe eval`:
# it preloads jemalloc, told to keep the memory it frees for reuse, where the machine has it (Debian/Ubuntu:
# libjemalloc2, which scripts/setup.sh installs where it can). Training returns the kept pages after each
# optimizer step, the heads fit after each recorded step and evaluations after each item (cepe.alloc.purge);
# a process that never purged them would grow without bound. glibc's malloc hands large tensors back to the
# kernel when they are freed and faults fresh pages in for the next; jemalloc ran a training step 14-19 %
# faster, 34 % under memory pressure, and the validation evaluations 15-32 % faster (docs/TRAINING.md,
# "Where a CPU step's time went"). Numerics are unchanged: only where tensors live changes.
# CEPE_MALLOC=system keeps glibc's malloc; CEPE_JEMALLOC=PATH names the library; an LD_PRELOAD already set
# is left as it is. Says what it chose on stderr.
if [ "${CEPE_MALLOC:-}" != system ] && [ -z "${LD_PRELOAD:-}" ]; then
  _cepe_je=${CEPE_JEMALLOC:-}
  if [ -z "$_cepe_je" ]; then
    for _cepe_dir in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib /usr/local/lib; do
      if [ -f "$_cepe_dir/libjemalloc.so.2" ]; then _cepe_je=$_cepe_dir/libjemalloc.so.2; break; fi
    done
  fi
  if [ -n "$_cepe_je" ] && [ -f "$_cepe_je" ]; then
    export LD_PRELOAD=$_cepe_je
    # every size through the arenas (none purged at once), freed pages kept rather than returned
    export MALLOC_CONF=${MALLOC_CONF:-oversize_threshold:0,background_thread:false,dirty_decay_ms:-1,muzzy_decay_ms:-1}
    echo "allocator: jemalloc ($_cepe_je, MALLOC_CONF=$MALLOC_CONF)" >&2
  else
    echo "allocator: the system malloc (no libjemalloc.so.2 found; apt-get install libjemalloc2 for faster CPU steps)" >&2
  fi
  unset _cepe_je _cepe_dir
fi
