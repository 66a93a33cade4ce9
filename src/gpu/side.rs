//! A second stream for a parallel branch of GPU work, forked from the [`Gpu`]'s stream and joined back into
//! it, plus a look at the shape of a captured graph (to test that a fork keeps the graph's PDL edges).
//!
//! Outside a capture the branch simply runs concurrently with the main stream. Inside a capture
//! ([`Gpu::capture`]) a fork makes the side stream join the capture: its next launch becomes a graph node
//! that depends on the main stream's last node (a parallel branch of the graph). The driver refuses to end a
//! capture with a branch that was never joined back (`CUDA_ERROR_STREAM_CAPTURE_UNJOINED`), so every forked
//! branch of a captured graph is joined before the capture ends, and a replay completes only when every
//! branch has: timing a graph replay counts its side branches.
//!
//! Fork and join are an event record on one stream plus an event wait on the other; they add no graph node
//! (the wait only adds the recorded node(s) to the waiting stream's dependencies) and, outside a capture, no
//! host synchronization. Each [`SideStream`] reuses two events: a wait binds to the event's most recent record
//! at the time of the wait, so recording the same event again later does not affect an earlier wait.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use cudarc::driver::{CudaEvent, CudaGraph, CudaStream};

use super::Gpu;

/// A non-blocking stream of the [`Gpu`]'s context for work that runs beside the main stream.
pub struct SideStream {
    stream: Arc<CudaStream>,
    fork_event: CudaEvent,
    join_event: CudaEvent,
}

impl SideStream {
    /// A new stream (non-blocking: no implicit ordering with any other stream) and its two events (timing
    /// disabled: they only order work).
    pub fn new(gpu: &Gpu) -> Result<SideStream> {
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| anyhow!("creating a side stream: {e:?}"))?;
        let ev = || {
            gpu.ctx
                .new_event(None)
                .map_err(|e| anyhow!("creating a fork/join event: {e:?}"))
        };
        Ok(SideStream {
            stream,
            fork_event: ev()?,
            join_event: ev()?,
        })
    }

    /// The side stream: launch the branch's work on it (between [`SideStream::fork`] and
    /// [`SideStream::join`]).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Work launched on the side stream from now on waits for everything enqueued on `gpu.stream` so far
    /// (inside a capture: depends on the main stream's last node). The main stream does not wait for anything.
    pub fn fork(&self, gpu: &Gpu) -> Result<()> {
        self.fork_event
            .record(&gpu.stream)
            .map_err(|e| anyhow!("fork: event record on the main stream: {e:?}"))?;
        self.stream
            .wait(&self.fork_event)
            .map_err(|e| anyhow!("fork: side stream wait: {e:?}"))
    }

    /// Work launched on `gpu.stream` from now on waits for everything enqueued on the side stream so far
    /// (inside a capture: the branch rejoins the capture's origin stream, as the driver requires before
    /// the capture ends). Call it before the first reader of the branch's outputs, and before host reads
    /// ([`Gpu::download`] and [`Gpu::synchronize`] only wait for the main stream).
    pub fn join(&self, gpu: &Gpu) -> Result<()> {
        self.join_event
            .record(&self.stream)
            .map_err(|e| anyhow!("join: event record on the side stream: {e:?}"))?;
        gpu.stream
            .wait(&self.join_event)
            .map_err(|e| anyhow!("join: main stream wait: {e:?}"))
    }
}

/// Node and edge counts of a captured graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphShape {
    pub nodes: usize,
    pub edges: usize,
    /// Edges other than a default full dependency (a type or an out-port other than the default): what a PDL
    /// launch captured after a kernel of the same stream becomes (a programmatic edge).
    pub programmatic_edges: usize,
}

/// The [`GraphShape`] of `g` (`cuGraphGetNodes`, `cuGraphGetEdges_v2`).
pub fn graph_shape(g: &CudaGraph) -> Result<GraphShape> {
    use cudarc::driver::sys;
    let cg = g.cu_graph();
    let mut nodes = 0usize;
    // SAFETY: a null node array asks only for the count.
    let r = unsafe { sys::cuGraphGetNodes(cg, std::ptr::null_mut(), &mut nodes) };
    r.result().map_err(|e| anyhow!("cuGraphGetNodes: {e:?}"))?;
    let mut edges = 0usize;
    // SAFETY: null from/to/data arrays ask only for the count.
    let r = unsafe {
        sys::cuGraphGetEdges_v2(
            cg,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut edges,
        )
    };
    r.result()
        .map_err(|e| anyhow!("cuGraphGetEdges_v2 (count): {e:?}"))?;
    let mut from: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); edges];
    let mut to: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); edges];
    // SAFETY: CUgraphEdgeData is plain bytes; zero is a valid value that the driver overwrites.
    let mut data: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; edges];
    let mut n = edges;
    // SAFETY: three arrays of `n` entries each; the driver writes at most `n` and returns the count in `n`.
    let r = unsafe {
        sys::cuGraphGetEdges_v2(
            cg,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut n,
        )
    };
    r.result()
        .map_err(|e| anyhow!("cuGraphGetEdges_v2: {e:?}"))?;
    let programmatic = data[..n.min(edges)]
        .iter()
        .filter(|d| {
            d.type_ != sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8
                || u32::from(d.from_port) != sys::CU_GRAPH_KERNEL_NODE_PORT_DEFAULT
        })
        .count();
    Ok(GraphShape {
        nodes,
        edges: n,
        programmatic_edges: programmatic,
    })
}
