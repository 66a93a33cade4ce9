//! Device-time measurement: CUDA events around each repetition (after warm-up), an optional L2 flush
//! outside the timed region, and CUDA-graph capture + replay for launch-overhead-free timing (docs/measurement.md).

use anyhow::{anyhow, Result};
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaSlice, CudaStream};

use super::{Gpu, Stream};

/// How to time a piece of GPU work.
#[derive(Debug, Clone, Copy)]
pub struct TimingPlan {
    pub warmup: usize,
    pub reps: usize,
    /// Evict L2 before every repetition (outside the timed events).
    pub flush_l2: bool,
}

impl Default for TimingPlan {
    fn default() -> Self {
        TimingPlan {
            warmup: 5,
            reps: 50,
            flush_l2: true,
        }
    }
}

/// A buffer twice the size of L2; writing it evicts whatever a kernel could reuse from L2, and reading it back
/// (`l2_flush_read`, kernels/measure.cu) leaves the lines clean, so the timed kernel's misses evict without writing
/// back, as in a decode step, where the kernel before a weight stream wrote only its small output. Measured against
/// a write-only flush (H100, bde2acd, results/h100/PERF-LOG.md): the dirty lines cost a 34 MB decode GEMV 25-28% of
/// its time inside the events.
pub struct L2Flush {
    buf: CudaSlice<u8>,
    read: Arc<super::launch::Kernel>,
    sink: CudaSlice<u32>,
    sms: u32,
}

impl L2Flush {
    pub fn new(gpu: &Gpu) -> Result<L2Flush> {
        let bytes = (gpu.info.l2_bytes * 2).max(128 << 20).next_multiple_of(16);
        Ok(L2Flush {
            buf: gpu.zeros::<u8>(bytes)?,
            read: gpu.kernel("measure", "l2_flush_read")?,
            sink: gpu.zeros::<u32>(1)?,
            sms: gpu.info.sm_count.max(1) as u32,
        })
    }
    /// Overwrite the buffer on `stream` (a memset), then read it back.
    pub fn flush(&mut self, stream: &Stream) -> Result<()> {
        super::fill_bytes_on(stream, &mut self.buf, 0x5A)?;
        let mut a = super::launch::KernelArgs::new();
        a.buf(&self.buf)
            .u64((self.buf.len() / 16) as u64)
            .buf(&self.sink);
        // SAFETY: `l2_flush_read(const uint4* p, size_t n, uint32_t* sink)`: p holds n 16-byte words (the length
        // is a multiple of 16), sink one word; grid-stride loop.
        unsafe {
            super::launch::launch(
                stream,
                &self.read,
                super::launch::Launch::new((4 * self.sms, 1, 1), (256, 1, 1)),
                &mut a,
            )
        }
    }
}

impl Gpu {
    /// [`Gpu::time_us_on`] the GPU's own stream.
    pub fn time_us(&self, plan: TimingPlan, work: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
        self.time_us_on(&self.stream, plan, work)
    }

    /// Time `work` (which enqueues its launches on `stream`) with one event pair per repetition, the L2 flush
    /// (when the plan asks for it) on the same stream before each pair. Returns one sample per repetition, in
    /// microseconds.
    pub fn time_us_on(
        &self,
        stream: &Stream,
        plan: TimingPlan,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        let mut flush = if plan.flush_l2 {
            // Allocated on the GPU's own stream: wait for it before `stream` writes it.
            let f = L2Flush::new(self)?;
            self.synchronize()?;
            Some(f)
        } else {
            None
        };
        let sync = || {
            stream
                .synchronize()
                .map_err(|e| anyhow!("stream synchronize (a kernel failed?): {e:?}"))
        };
        for _ in 0..plan.warmup {
            work()?;
        }
        sync()?;
        let ev = || {
            self.ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| anyhow!("event: {e:?}"))
        };
        let mut pairs = Vec::with_capacity(plan.reps);
        for _ in 0..plan.reps {
            if let Some(f) = flush.as_mut() {
                f.flush(stream)?;
            }
            let (a, b) = (ev()?, ev()?);
            a.record(stream).map_err(|e| anyhow!("{e:?}"))?;
            work()?;
            b.record(stream).map_err(|e| anyhow!("{e:?}"))?;
            pairs.push((a, b));
        }
        sync()?;
        pairs
            .iter()
            .map(|(a, b)| {
                a.elapsed_ms(b)
                    .map(|ms| ms as f64 * 1e3)
                    .map_err(|e| anyhow!("elapsed: {e:?}"))
            })
            .collect()
    }

    /// Capture `work` into a CUDA graph (thread-local capture mode on our stream).
    pub fn capture(&self, work: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
        capture_on(&self.stream, work)
    }
}

/// Capture the work that `work` enqueues on `stream` (and on streams that join it) into a CUDA graph, uploaded
/// and ready to launch. Any launch that allocates, synchronizes or copies to the host fails the capture: a
/// graph-safe launcher does none of these.
pub fn capture_on(
    stream: &Arc<CudaStream>,
    work: impl FnOnce() -> Result<()>,
) -> Result<CudaGraph> {
    {
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow!("begin capture: {e:?}"))?;
        let r = work();
        let g = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(|e| anyhow!("end capture: {e:?}"))?;
        r?;
        let g = g.ok_or_else(|| anyhow!("graph capture recorded no work"))?;
        g.upload().map_err(|e| anyhow!("graph upload: {e:?}"))?;
        Ok(g)
    }
}

/// The kernel nodes of a captured graph (what one replay launches; memsets, copies and event records are not
/// counted).
pub fn graph_kernel_count(graph: &CudaGraph) -> Result<usize> {
    use cudarc::driver::sys::{cuGraphGetNodes, cuGraphNodeGetType, CUgraphNodeType, CUresult};
    let g = graph.cu_graph();
    let mut n = 0usize;
    // SAFETY: `g` is the live graph `graph` owns; the first call only reads the node count, the second writes
    // at most `n` handles into a buffer of `n`.
    let r = unsafe { cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(anyhow!("cuGraphGetNodes: {r:?}"));
    }
    let mut nodes = vec![std::ptr::null_mut(); n];
    let r = unsafe { cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(anyhow!("cuGraphGetNodes: {r:?}"));
    }
    let mut kernels = 0;
    for &node in &nodes[..n] {
        let mut t = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is one of the handles the graph just returned.
        let r = unsafe { cuGraphNodeGetType(node, &mut t) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(anyhow!("cuGraphNodeGetType: {r:?}"));
        }
        if t == CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            kernels += 1;
        }
    }
    Ok(kernels)
}

impl Gpu {
    /// Time replays of a captured graph: `inner` replays between each event pair, sample = time / inner.
    pub fn time_graph_us(
        &self,
        graph: &CudaGraph,
        plan: TimingPlan,
        inner: usize,
    ) -> Result<Vec<f64>> {
        let inner = inner.max(1);
        self.time_us(plan, || {
            for _ in 0..inner {
                graph.launch().map_err(|e| anyhow!("graph launch: {e:?}"))?;
            }
            Ok(())
        })
        .map(|v| v.into_iter().map(|us| us / inner as f64).collect())
    }
}
