//! Named CUDA events on a stream ([`EventMarks`]): the engine's profiled step and the per-kernel marks of
//! [`super::launch::with_launch_marks`] time a graph replay by the events recorded between its kernels.

use anyhow::{anyhow, Result};
use cudarc::driver::sys::CUevent_flags;
use std::sync::Arc;

use super::Stream;

/// Named events recorded on a stream, in stream order: the time of a mark is the time between its event and the
/// one before it (the first mark is the start). Recorded inside a stream capture, each event becomes an
/// event-record node that every replay executes, so the marks time a graph's replay.
pub struct EventMarks {
    ctx: Arc<cudarc::driver::CudaContext>,
    /// `(place, name, event)`: the place is the mark's position among every mark recorded by any `EventMarks`
    /// (it interleaves two sets).
    events: std::cell::RefCell<Vec<(u64, String, cudarc::driver::CudaEvent)>>,
}

/// The next mark's place in the order of all marks of the process.
static NEXT_MARK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl EventMarks {
    pub fn new(stream: &Stream) -> EventMarks {
        EventMarks {
            ctx: stream.context().clone(),
            events: Default::default(),
        }
    }

    /// Records an event named `what` on `stream`.
    pub fn mark(&self, stream: &Stream, what: impl Into<String>) -> Result<()> {
        use cudarc::driver::sys::{self, CUstreamCaptureStatus};
        let ev = self
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| anyhow!("event: {e:?}"))?;
        let capturing = stream
            .capture_status()
            .map_err(|e| anyhow!("capture status: {e:?}"))?
            == CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE;
        if capturing {
            // Inside a capture a plain cuEventRecord only marks a fork/join point; the EXTERNAL flag makes it an
            // event-record node that every replay executes, so the event can be timed after a replay.
            // SAFETY: a live event and stream of the same context.
            unsafe {
                sys::cuEventRecordWithFlags(
                    ev.cu_event(),
                    stream.cu_stream(),
                    sys::CUevent_record_flags_enum::CU_EVENT_RECORD_EXTERNAL as u32,
                )
            }
            .result()
            .map_err(|e| anyhow!("event record node: {e:?}"))?;
        } else {
            ev.record(stream)
                .map_err(|e| anyhow!("event record: {e:?}"))?;
        }
        let place = NEXT_MARK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.events.borrow_mut().push((place, what.into(), ev));
        Ok(())
    }

    /// `(place, name)` of every mark, in order: the place orders marks of different `EventMarks` recorded in one
    /// program order (a step's group marks against its kernel marks).
    pub fn sequence(&self) -> Vec<(u64, String)> {
        self.events
            .borrow()
            .iter()
            .map(|(o, n, _)| (*o, n.clone()))
            .collect()
    }

    /// `(name, microseconds)` of every mark after the first, in order (waits for the events).
    pub fn durations(&self) -> Result<Vec<(String, f64)>> {
        let ev = self.events.borrow();
        ev.windows(2)
            .map(|w| {
                let ms = w[0]
                    .2
                    .elapsed_ms(&w[1].2)
                    .map_err(|e| anyhow!("elapsed: {e:?}"))?;
                Ok((w[1].1.clone(), ms as f64 * 1e3))
            })
            .collect()
    }
}
