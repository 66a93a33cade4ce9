//! The communicator of a rank and the combine's transport (docs/multi-gpu.md, "The combine"): every rank's f32
//! partial rows are all-gathered (`ncclAllGather`, on the step's stream, so a captured graph holds it), then one
//! kernel sums them in rank order and adds the shared expert (`ops::ep::combine`).
//!
//! A world of one rank has no communicator and never loads NCCL: the all-gather of one partial is the partial
//! itself, so the combine reads it in place. NCCL is opened (dynamic loading, cudarc's `nccl-02024` binding) only
//! when a world of more than one rank is asked for; without the library that is an error that says so
//! ([`nccl_check`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, ensure, Result};
use cudarc::driver::CudaSlice;
use cudarc::nccl::{result::NcclError, Comm, Id};
use half::bf16;

use crate::gpu::{DeviceBuf, Gpu, Stream};
use crate::ops::ep;

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const NCCL_ID_BYTES: usize = 128;

/// The NCCL unique id as hex (256 characters): what `MEGAMOE_NCCL_ID` carries from the parent to the ranks.
pub fn id_to_hex(id: &[u8; NCCL_ID_BYTES]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// [`id_to_hex`]'s inverse; an error names what is wrong with the text.
pub fn id_from_hex(hex: &str) -> Result<[u8; NCCL_ID_BYTES]> {
    let hex = hex.trim();
    ensure!(
        hex.len() == 2 * NCCL_ID_BYTES,
        "an NCCL id is {} hex characters, got {}",
        2 * NCCL_ID_BYTES,
        hex.len()
    );
    let mut id = [0u8; NCCL_ID_BYTES];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|_| anyhow!("the NCCL id has a non-hex pair at {}", 2 * i))?;
    }
    Ok(id)
}

/// An NCCL error with its code and NCCL's own words.
fn nccl_error(what: &str, e: NcclError) -> anyhow::Error {
    // SAFETY: NCCL is loaded (the call that failed went through it); the string is static in the library.
    let words = unsafe {
        let p = cudarc::nccl::sys::ncclGetErrorString(e.0);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    anyhow!("{what}: NCCL {:?} ({words})", e.0)
}

/// Where a `libnccl.so.2` may be when no `libnccl.so` is on the loader's path (distribution packages install only the
/// versioned name; cudarc opens the unversioned one): `MEGAMOE_NCCL_LIB` first, then the usual library folders.
pub fn nccl_library_candidates() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::env::var_os("MEGAMOE_NCCL_LIB")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    for dir in [
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/local/cuda/lib64",
        "/usr/lib64",
        "/usr/local/lib",
    ] {
        v.push(Path::new(dir).join("libnccl.so.2"));
    }
    v
}

/// Whether cudarc can open NCCL in this process.
pub fn nccl_loadable() -> bool {
    // SAFETY: only tries to open the library (and closes it again).
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// What a world of more than one rank needs before its first NCCL call: `Ok` when cudarc can open NCCL here, else an
/// error that says where it looked. ([`crate::dist::launch`] makes a versioned-only library loadable for itself and
/// its ranks before it gets here.)
pub fn nccl_check() -> Result<()> {
    if nccl_loadable() {
        return Ok(());
    }
    bail!(
        "NCCL could not be loaded: a world of more than one rank needs libnccl (cudarc opens libnccl.so; looked \
         for a libnccl.so.2 to link it from at {}; set MEGAMOE_NCCL_LIB to its path). One rank needs no NCCL.",
        nccl_library_candidates()
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// NCCL's version as `major.minor.patch` (NCCL must be loadable: [`nccl_check`]).
pub fn nccl_version() -> Result<String> {
    nccl_check()?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: NCCL is loadable (checked); ncclGetVersion writes one int.
    let r = unsafe { cudarc::nccl::sys::ncclGetVersion(&mut v) };
    r.result().map_err(|e| nccl_error("ncclGetVersion", e))?;
    // NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since 2.9.
    Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

/// A fresh NCCL unique id (`ncclGetUniqueId`; NCCL must be loadable).
pub fn new_id() -> Result<[u8; NCCL_ID_BYTES]> {
    nccl_check()?;
    let id = Id::new().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
    Ok(id.internal().map(|c| c as u8))
}

/// One rank's place in the world and its communicator (none in a world of one).
pub struct Communicator {
    pub rank: usize,
    pub world: usize,
    comm: Option<Comm>,
}

impl Communicator {
    /// The world of one rank: no NCCL.
    pub fn single() -> Communicator {
        Communicator {
            rank: 0,
            world: 1,
            comm: None,
        }
    }

    /// Rank `rank` of `world`: with `world == 1` [`Communicator::single`] (the id is ignored); otherwise
    /// `ncclCommInitRank` with the parent's id, bound to the GPU's stream (every collective is enqueued there).
    /// Blocks until every rank of the world has joined.
    pub fn new(
        gpu: &Gpu,
        rank: usize,
        world: usize,
        id: Option<&[u8; NCCL_ID_BYTES]>,
    ) -> Result<Communicator> {
        ensure!(world >= 1, "a world of 0 ranks");
        ensure!(rank < world, "rank {rank} outside a world of {world}");
        if world == 1 {
            return Ok(Communicator::single());
        }
        let Some(id) = id else {
            bail!("rank {rank} of {world}: no NCCL id (MEGAMOE_NCCL_ID)")
        };
        nccl_check()?;
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(gpu.stream.clone(), rank, world, id)
            .map_err(|e| nccl_error(&format!("ncclCommInitRank (rank {rank} of {world})"), e))?;
        Ok(Communicator {
            rank,
            world,
            comm: Some(comm),
        })
    }

    /// `ncclAllGather` of `send` (`n` values) into `recv` (`world x n`, rank r's at `r n`) on `stream`, which must be
    /// the communicator's (the GPU's) stream. A world of one: an error (the combine reads its partial in place).
    pub fn all_gather_f32(
        &self,
        stream: &Stream,
        send: &CudaSlice<f32>,
        recv: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let Some(comm) = &self.comm else {
            bail!("all-gather in a world of one rank (the partial is its own gather)")
        };
        ensure!(
            Arc::ptr_eq(stream, &comm.stream()),
            "the all-gather must run on the communicator's stream (the GPU's stream)"
        );
        ensure!(
            recv.len() >= self.world * send.len(),
            "all-gather: {} values received for {} ranks x {}",
            recv.len(),
            self.world,
            send.len()
        );
        comm.all_gather(send, recv)
            .map_err(|e| nccl_error("ncclAllGather", e))?;
        Ok(())
    }
}

/// The combine's buffers on one rank: its partial `[B, D]` f32 and, in a world of more than one rank, the gathered
/// partials `[W, B, D]` f32.
pub struct Combine {
    /// This rank's routed sum (what `FfnHalf::run_to_partial` writes).
    pub partial: CudaSlice<f32>,
    /// Every rank's partial after the all-gather (none in a world of one).
    pub gathered: Option<CudaSlice<f32>>,
    pub elems: usize,
}

impl Combine {
    /// Buffers for `elems` (= B D) values per rank, poisoned (0xFF: NaN) so an unwritten value shows.
    pub fn new(gpu: &Gpu, world: usize, elems: usize) -> Result<Combine> {
        Ok(Combine {
            partial: gpu.poisoned::<f32>(elems, 0xFF)?,
            gathered: if world > 1 {
                Some(gpu.poisoned::<f32>(world * elems, 0xFF)?)
            } else {
                None
            },
            elems,
        })
    }

    /// The all-gather (none in a world of one), then `out = bf16(sum of the partials in rank order + shared)`.
    pub fn run(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        comm: &Communicator,
        shared: Option<&dyn DeviceBuf<bf16>>,
        out: &dyn DeviceBuf<bf16>,
    ) -> Result<()> {
        match &mut self.gathered {
            None => {
                ensure!(
                    comm.world == 1,
                    "the combine of a world of {} has no gather buffer",
                    comm.world
                );
                ep::combine(gpu, stream, &self.partial, 1, self.elems, shared, out)
            }
            Some(all) => {
                comm.all_gather_f32(stream, &self.partial, all)?;
                ep::combine(gpu, stream, all, comm.world, self.elems, shared, out)
            }
        }
    }
}
