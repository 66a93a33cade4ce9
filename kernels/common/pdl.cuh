// Programmatic dependent launch (PDL, sm_90): the two instructions and the rules every user of them follows.
//
// A kernel launched with the programmatic-stream-serialization attribute (gpu::launch::Launch::pdl) may be
// scheduled while the previous kernel of the stream still runs: as soon as every CTA of that kernel has issued
// `pdl_trigger()` or exited. `pdl_wait()` then blocks until every prerequisite grid has COMPLETED and its memory
// operations are visible (PTX ISA: wherever the prerequisite triggered), so everything after the wait is ordered
// after the previous kernel exactly as under a plain launch. Without the attribute on the dependent, the trigger
// has no effect and the wait returns at once: every kernel that uses these is also correct when launched plainly.
//
// Rules (the whole correctness argument):
//   * Before its pdl_wait(), a PDL-launched kernel reads only constant data that no kernel writes (weights, their
//     scales, kernel parameters) and writes only its own shared memory. RAW and WAR on every buffer a kernel writes
//     are therefore ordered as in plain stream order.
//   * Every CTA of a PDL-launched kernel executes pdl_wait() before it exits, unless it touches no global memory at
//     all; so "grid i complete" implies "grid i-1 complete" down the stream.
//   * A trigger only lets the next kernel's CTAs become resident early; it never affects correctness. No deadlock:
//     a grid is scheduled only after every CTA of the previous grid is resident or done, so parked CTAs never keep
//     an earlier grid's CTA from starting.
// Users: the decode GEMV (kernels/dense.cu: weight prefetch before the wait), its plain-launched predecessors
// (trigger first), the mHC pair (kernels/mhc.cu) and the top-k chain (kernels/indexer.cu); their own notes say
// what each does before its wait.
#pragma once

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
