//! Kernel families. Each reads the same way (DESIGN §1): `kernels/<family>.cu` (device code) ->
//! `ops/<family>/mod.rs` (launcher: checks before any launch, config choice, launch) ->
//! `ops/<family>/reference.rs` or `formats` (CPU reference) -> `tests/<family>.rs` -> `bench-configs/<family>.toml`.
//!
//! (attn branch: main's `exec`, `inputs`, `nvfp4` and `bench_kernels()` need `bench::runner`, which main does
//! not have yet and main's lib.rs does not compile `ops`; they are left out here until that lands.)

pub mod sparse_attn;
