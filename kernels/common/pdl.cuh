// Programmatic dependent launch (PDL, sm_90) for every kernel entry point: `pdl_enter()` is the FIRST statement of
// each `extern "C" __global__` function in kernels/*.cu (tests/pdl_coverage.rs checks it), except the entry
// points with their own griddepcontrol protocol (listed in src/gpu/launch.rs, PDL_OWN_PROTOCOL).
//
// Contract:
//   * Without the launch attribute (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) both instructions are
//     no-ops: the kernel behaves exactly as before.
//   * With it, the kernel may be scheduled while the previous kernel(s) of the stream still run.
//     `griddepcontrol.wait` blocks until every prerequisite grid has COMPLETED and its memory operations are
//     performed and visible to this grid (PTX ISA: independent of where the prerequisite triggered). As the first
//     statement, before any global read or write, it orders all of this kernel's reads and writes (RAW and WAR)
//     after the previous kernel exactly as a plain launch would. Every CTA executes it before it can exit, so
//     "this grid complete" implies "the previous grid complete": the ordering is transitive down the stream.
//   * `griddepcontrol.launch_dependents` after the wait lets the NEXT kernel of the stream be scheduled while this
//     one runs (once every CTA of this grid has issued it or exited); that kernel then parks in its own
//     pdl_enter() until this grid completes. Where the trigger sits never affects correctness, only overlap.
//
// Why wait before trigger: one level of overlap and no more. Were the trigger first, kernel N+1 could launch and
// trigger before kernel N-1 finished, then N+2 and so on: a cascade of grids whose CTAs sit parked in their waits,
// holding SM slots (registers, shared memory) that the kernel doing the work could use. With the wait first, kernel
// N triggers only after N-1 completed, so at most two grids of the stream are resident: the one running and the
// next one parked at its first instruction. No deadlock: a grid is launched only once every CTA of the one before
// it is resident (issued the trigger) or finished, so parked CTAs never keep an earlier grid's CTA from starting.
#pragma once

__device__ __forceinline__ void pdl_enter() {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
