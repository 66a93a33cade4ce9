//! Which engine runs a decode dense linear: this family's CUDA-core GEMV (kernels/dense.cu, split-K) or cuBLASLt's
//! tensor-core GEMMs (`Blas::bf16_gemm_f32` for the BF16 linears, `prefill::fp8_linears_prefill`'s block-scaled FP8
//! GEMM for the FP8 ones). The rule lives here, apart from the launchers, with the measurements that justify it.
//!
//! The measurements (results/h100/dense.csv, commit b3bf70a, H100; us at M = 1 / 16 / 32 / 64 rows, this family's
//! GEMV vs cuBLASLt BF16 with a BF16 output, which even reads 2x the bytes for the FP8 weights): the GEMV's time grows
//! with M beyond ~8 rows while the tensor cores' stays flat.
//!
//! | linear | GEMV | cuBLASLt BF16 |
//! |---|---|---|
//! | wq_a fp8 n=1024 k=4096 | 11 / 19 / 33 / 49 | 11 / 12 / 12 / 12 |
//! | wq_b fp8 n=32768 k=1024 | 27 / 30 / 35 / 49 | 35 / 35 / 35 / 36 |
//! | wo_b fp8 n=4096 k=8192 | 30 / 36 / 48 / 67 | 37 / 37 / 37 / 38 |
//! | shared swiglu n=2048 k=4096 | 20 / 31 / 54 / 86 | 23 / 22 / 21 / 22 |
//! | bf16 n=64 k=4096 (indexer weights_proj) | 9 / 20 / 32 / 66 | 9 / 9 / 9 / 9 |
//! | bf16 jobs=2 n=1024 k=4096 (compressors) | 18 / 22 / 28 / 45 | 20 / 21 / 22 / 23 |
//! | bf16 n=129280 k=4096 (LM head) | 507 / 545 / 620 / 797 | 365 / 367 / 369 / 378 |
//!
//! The rule ([`DenseRoute::Auto`], [`auto_path`]):
//! * BF16 linears go to the tensor cores from [`BF16_TC_MIN_ROWS`] rows (at 16 every BF16 row above is at or past
//!   the crossing), and at every M when the weight has at least [`BF16_TC_ALWAYS_ELEMENTS`] elements (the LM head:
//!   cuBLASLt wins even at M = 1, 365 vs 507 us).
//! * FP8 linears (`fp8_linear`, `fp8_linears`, the shared expert's w2) go to the block-scaled FP8 GEMM from
//!   [`FP8_TC_MIN_ROWS`] rows: at 32 the GEMV is 1.4-2.8x the BF16 GEMM's time on every FP8 row above, at 16 it
//!   still wins wq_b and wo_b. The block-scaled GEMM itself has not been timed at M <= 64 yet (the bench's
//!   `cublaslt_block_scaled` variant at M = 1..64, bench-configs/dense.toml, pins this threshold on the next GPU
//!   run); the FP8 route also needs the weight's f32 block scales ([`super::Fp8Weight::scales_f32`]), without them
//!   the GEMV runs.
//! * The shared expert's SwiGLU half (`swiglu_fp8`, its fused epilogue has no cuBLASLt twin) and the grouped wo_a
//!   (BF16 activations on an FP8 weight) stay on the GEMV.
//!
//! Above [`super::MAX_ROWS`] rows (chunked prefill), every linear with a tensor-core route takes it whatever the
//! route in force ([`path_for`]); the rest run as GEMV pieces of [`super::MAX_ROWS`] rows ([`super::row_pieces`]).
//!
//! The route in force is a per-thread setting ([`with_route`]), read when a
//! [`super::DenseWorkspace`] is laid out and carved: the workspace records it ([`super::DenseWorkspace::route`]) and
//! carries the tensor-core route's scratch only when a shape it was carved for takes that route, so every launch on
//! it takes the route it was sized for (graph captures included). The default is [`DEFAULT_ROUTE`].

/// Which engine a launch takes: the setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DenseRoute {
    /// The measured rule ([`auto_path`]).
    Auto,
    /// Always this family's GEMV (the behaviour before the tensor-core route existed).
    Gemv,
    /// The tensor cores for every linear that has a tensor-core route (FP8 with f32 weight scales, BF16), at any M:
    /// the forcing variant of the A/B.
    TensorCores,
}

/// Which engine a launch takes: the decision for one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DensePath {
    /// kernels/dense.cu.
    Gemv,
    /// cuBLASLt (one GEMM per job).
    TensorCores,
}

/// The route when nothing is set: the GEMV, this family's own kernel (its benches and the engine's per-layer tests
/// are built on it). The engine's commands default to [`DenseRoute::Auto`] (`megamoe decode --dense-route`), which
/// won its A/B in the engine (results/h100/PERF-LOG.md).
pub const DEFAULT_ROUTE: DenseRoute = DenseRoute::Gemv;

/// BF16 linears take the tensor cores from this many rows (see the module's table).
pub const BF16_TC_MIN_ROWS: usize = 16;

/// BF16 weights of at least this many elements (`n * k`, 2^28: the LM head, 129280 x 4096 or x 7168) take the tensor
/// cores at every M: one GEMV pass over 1 GB is already slower than cuBLASLt at M = 1.
pub const BF16_TC_ALWAYS_ELEMENTS: usize = 1 << 28;

/// FP8 linears take the block-scaled tensor-core GEMM from this many rows (see the module's table).
pub const FP8_TC_MIN_ROWS: usize = 32;

impl DenseRoute {
    /// `auto`, `gemv` or `tensor-cores` (the `--dense-route` values).
    pub fn parse(s: &str) -> Result<DenseRoute, String> {
        match s {
            "auto" => Ok(DenseRoute::Auto),
            "gemv" => Ok(DenseRoute::Gemv),
            "tensor-cores" | "tc" => Ok(DenseRoute::TensorCores),
            _ => Err(format!("`{s}`: expected auto, gemv or tensor-cores")),
        }
    }
    /// The name [`DenseRoute::parse`] reads (and decode.csv writes).
    pub fn name(self) -> &'static str {
        match self {
            DenseRoute::Auto => "auto",
            DenseRoute::Gemv => "gemv",
            DenseRoute::TensorCores => "tensor-cores",
        }
    }
}

/// Whether `shape` has a tensor-core route at all: FP8 weight on FP8 rows (`fp8_linear(s)`) and BF16 linears whose
/// f32 output rows are 16-byte multiples (`n % 4 == 0` for the tallest job; every engine shape) and whose K is a
/// multiple of 8 (the dense rules already ask 32).
pub fn has_tensor_core_route(shape: &super::DenseShape) -> bool {
    match shape.kind {
        super::DenseKind::Fp8 => true,
        super::DenseKind::Bf16 => shape.n.is_multiple_of(4) && shape.k.is_multiple_of(8),
        super::DenseKind::Fp8Bf16x
        | super::DenseKind::Swiglu
        | super::DenseKind::Fp8QuantX
        | super::DenseKind::Fp8NormQuantX => false,
    }
}

/// The measured rule (module docs) for `shape`.
pub fn auto_path(shape: &super::DenseShape) -> DensePath {
    if !has_tensor_core_route(shape) {
        return DensePath::Gemv;
    }
    let tc = match shape.kind {
        super::DenseKind::Bf16 => {
            shape.rows >= BF16_TC_MIN_ROWS || shape.n * shape.k >= BF16_TC_ALWAYS_ELEMENTS
        }
        super::DenseKind::Fp8 => shape.rows >= FP8_TC_MIN_ROWS,
        super::DenseKind::Fp8Bf16x
        | super::DenseKind::Swiglu
        | super::DenseKind::Fp8QuantX
        | super::DenseKind::Fp8NormQuantX => false,
    };
    if tc {
        DensePath::TensorCores
    } else {
        DensePath::Gemv
    }
}

/// The engine `route` sends `shape` to (before the FP8 route's need for f32 weight scales, which only the launch
/// sees: [`super::DenseWorkspace::path`]).
pub fn path_for(route: DenseRoute, shape: &super::DenseShape) -> DensePath {
    // Above the GEMV's row capacity (a prefill chunk) the GEMV runs in pieces that each stream the weight again:
    // the tensor cores take every shape they can, whatever the route.
    if shape.rows > super::MAX_ROWS {
        return if has_tensor_core_route(shape) {
            DensePath::TensorCores
        } else {
            DensePath::Gemv
        };
    }
    match route {
        DenseRoute::Gemv => DensePath::Gemv,
        DenseRoute::TensorCores if has_tensor_core_route(shape) => DensePath::TensorCores,
        DenseRoute::TensorCores => DensePath::Gemv,
        DenseRoute::Auto => auto_path(shape),
    }
}

thread_local! {
    static ROUTE: std::cell::Cell<DenseRoute> = const { std::cell::Cell::new(DEFAULT_ROUTE) };
}

/// Runs `work` with `route` in force on this thread: every dense workspace laid out and carved inside takes it
/// (the launches follow their workspace's). Nests, the innermost wins; the previous setting returns after `work`.
pub fn with_route<R>(route: DenseRoute, work: impl FnOnce() -> R) -> R {
    let before = ROUTE.with(|r| r.replace(route));
    let out = work();
    ROUTE.with(|r| r.set(before));
    out
}

/// The route in force on this thread ([`DEFAULT_ROUTE`] outside any [`with_route`]).
pub fn route_in_force() -> DenseRoute {
    ROUTE.with(|r| r.get())
}

#[cfg(test)]
mod tests {
    use super::super::{DenseKind, DenseShape};
    use super::*;

    /// The rule's table at the measured rows (module docs), for DSV4-Flash's shapes.
    #[test]
    fn auto_follows_the_measured_table() {
        use DensePath::{Gemv as G, TensorCores as T};
        let rows = [1, 8, 15, 16, 31, 32, 33, 64];
        let cases: [(DenseShape, [DensePath; 8]); 8] = [
            // wq_a, wq_b, wo_b: FP8 from 32 rows.
            (
                DenseShape::new(DenseKind::Fp8, 1, 1024, 4096, 1),
                [G, G, G, G, G, T, T, T],
            ),
            (
                DenseShape::new(DenseKind::Fp8, 1, 32768, 1024, 1),
                [G, G, G, G, G, T, T, T],
            ),
            (
                DenseShape::new(DenseKind::Fp8, 1, 4096, 8192, 2),
                [G, G, G, G, G, T, T, T],
            ),
            // weights_proj, compressors: BF16 from 16 rows.
            (
                DenseShape::new(DenseKind::Bf16, 1, 64, 4096, 1),
                [G, G, G, T, T, T, T, T],
            ),
            (
                DenseShape::new(DenseKind::Bf16, 1, 1024, 4096, 2),
                [G, G, G, T, T, T, T, T],
            ),
            // The LM head: always.
            (DenseShape::new(DenseKind::Bf16, 1, 129280, 4096, 1), [T; 8]),
            // The SwiGLU half and wo_a: never.
            (DenseShape::new(DenseKind::Swiglu, 1, 2048, 4096, 1), [G; 8]),
            (
                DenseShape::new(DenseKind::Fp8Bf16x, 1, 1024, 4096, 8),
                [G; 8],
            ),
        ];
        for (shape, want) in cases {
            for (&m, &w) in rows.iter().zip(&want) {
                let at = DenseShape { rows: m, ..shape };
                assert_eq!(auto_path(&at), w, "{at:?}");
                assert_eq!(path_for(DenseRoute::Auto, &at), w, "{at:?}");
                assert_eq!(path_for(DenseRoute::Gemv, &at), G, "{at:?}");
                let forced = if matches!(shape.kind, DenseKind::Fp8 | DenseKind::Bf16) {
                    T
                } else {
                    G
                };
                assert_eq!(path_for(DenseRoute::TensorCores, &at), forced, "{at:?}");
            }
        }
        // Pro's LM head too; a BF16 weight whose f32 rows are not 16-byte multiples has no tensor-core route.
        assert_eq!(
            auto_path(&DenseShape::new(DenseKind::Bf16, 1, 129280, 7168, 1)),
            T
        );
        assert_eq!(
            auto_path(&DenseShape::new(DenseKind::Bf16, 64, 130, 96, 1)),
            G
        );
        assert_eq!(
            path_for(
                DenseRoute::TensorCores,
                &DenseShape::new(DenseKind::Bf16, 64, 1, 32, 1)
            ),
            G
        );
        assert_eq!(BF16_TC_ALWAYS_ELEMENTS, 268_435_456);
    }

    /// Above the GEMV's 64 rows every route sends the FP8 and BF16 linears to the tensor cores (the GEMV would run
    /// in pieces), and the SwiGLU half and wo_a to the GEMV pieces; at 64 rows and below nothing changed.
    #[test]
    fn calls_above_the_gemv_rows_take_the_tensor_cores_where_they_can() {
        use DensePath::{Gemv as G, TensorCores as T};
        for route in [DenseRoute::Gemv, DenseRoute::Auto, DenseRoute::TensorCores] {
            for rows in [65, 256, 512, 4096] {
                assert_eq!(
                    path_for(route, &DenseShape::new(DenseKind::Fp8, rows, 1024, 4096, 2)),
                    T
                );
                assert_eq!(
                    path_for(route, &DenseShape::new(DenseKind::Bf16, rows, 64, 4096, 1)),
                    T
                );
                assert_eq!(
                    path_for(
                        route,
                        &DenseShape::new(DenseKind::Swiglu, rows, 2048, 4096, 1)
                    ),
                    G
                );
                assert_eq!(
                    path_for(
                        route,
                        &DenseShape::new(DenseKind::Fp8Bf16x, rows, 1024, 4096, 8)
                    ),
                    G
                );
                // A BF16 weight the tensor cores cannot take: GEMV pieces.
                assert_eq!(
                    path_for(route, &DenseShape::new(DenseKind::Bf16, rows, 130, 96, 1)),
                    G
                );
            }
            assert_eq!(
                path_for(route, &DenseShape::new(DenseKind::Fp8, 64, 1024, 4096, 2)) == T,
                route != DenseRoute::Gemv
            );
        }
        let pieces: Vec<_> = super::super::row_pieces(150).collect();
        assert_eq!(pieces, vec![(0, 64), (64, 64), (128, 22)]);
        assert_eq!(
            super::super::row_pieces(64).collect::<Vec<_>>(),
            vec![(0, 64)]
        );
        assert_eq!(super::super::row_pieces(512).count(), 8);
    }

    #[test]
    fn the_route_is_scoped_and_parses_its_names() {
        assert_eq!(route_in_force(), DEFAULT_ROUTE);
        assert_eq!(DEFAULT_ROUTE, DenseRoute::Gemv);
        let inner = with_route(DenseRoute::Auto, || {
            let nested = with_route(DenseRoute::TensorCores, route_in_force);
            (route_in_force(), nested)
        });
        assert_eq!(inner, (DenseRoute::Auto, DenseRoute::TensorCores));
        assert_eq!(route_in_force(), DEFAULT_ROUTE);
        for r in [DenseRoute::Auto, DenseRoute::Gemv, DenseRoute::TensorCores] {
            assert_eq!(DenseRoute::parse(r.name()), Ok(r));
        }
        assert!(DenseRoute::parse("fast").is_err());
    }
}
