//! Kernel timelines from CUPTI's activity API ([`trace_kernels`]): every kernel that some GPU work ran (graph
//! kernel nodes and cuBLASLt's kernels included) with the GPU's own start and end timestamps. Unlike the event
//! marks (`super::marks`), nothing is inserted between the kernels, so a graph replay keeps its launch gaps and
//! its PDL overlaps, and a kernel's time is its own.
//!
//! CUPTI is loaded at run time (`libcupti.so.13`, CUDA 13.0's: the kernel records are read as that version's
//! `CUpti_ActivityKernel10`); `scripts/gpu-bundle.sh` ships it beside the binary. Where it cannot be loaded or
//! refuses to trace (some sandboxed machines), [`trace_kernels`] says why in its error and the caller goes on
//! without a timeline. `CONCURRENT_KERNEL` records do not serialize kernels (the `KERNEL` kind would).

use super::launch::LIBRARY_MARK;
use anyhow::{anyhow, bail, ensure, Result};
use cudarc::cupti::sys as cupti;
use std::sync::{Mutex, OnceLock};

/// One kernel as the GPU ran it. Timestamps are the GPU's, in nanoseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelSpan {
    /// The kernel's entry point (as CUPTI reports it: cuBLASLt's are mangled C++ names).
    pub name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub stream: u32,
}

/// The CUPTI API version the kernel records are parsed for (cupti_version.h of CUDA 13.0: `CUPTI_API_VERSION`).
/// Later 13.x versions keep `CUpti_ActivityKernel10` as the `CONCURRENT_KERNEL` record.
const CUPTI_MAJOR: u32 = 13;
const BUFFER_BYTES: usize = 8 << 20;
const BUFFER_ALIGN: usize = 8;

/// Spans of the completed buffers of the trace in progress.
static SPANS: Mutex<Vec<KernelSpan>> = Mutex::new(Vec::new());
/// One trace at a time (CUPTI's activity state is process-wide).
static TRACE_LOCK: Mutex<()> = Mutex::new(());
/// Callbacks are registered once per process.
static CALLBACKS: OnceLock<std::result::Result<(), String>> = OnceLock::new();

fn buffer_layout() -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(BUFFER_BYTES, BUFFER_ALIGN).expect("constant layout")
}

extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // SAFETY: CUPTI passes valid out-pointers; the buffer is freed in buffer_completed, which CUPTI calls for
    // every buffer it requested (at the latest on the forced flush of trace_kernels).
    unsafe {
        let p = std::alloc::alloc(buffer_layout());
        *buffer = p;
        *size = if p.is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0; // as many as fit
    }
}

extern "C" fn buffer_completed(
    _ctx: cudarc::driver::sys::CUcontext,
    _stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    if buffer.is_null() {
        return;
    }
    let spans = parse_buffer(buffer, valid);
    if let Ok(mut s) = SPANS.lock() {
        s.extend(spans);
    }
    // SAFETY: allocated by buffer_requested with this layout.
    unsafe { std::alloc::dealloc(buffer, buffer_layout()) };
}

/// The kernel records of one completed buffer (other record kinds are skipped).
fn parse_buffer(buffer: *mut u8, valid: usize) -> Vec<KernelSpan> {
    let mut out = Vec::new();
    let mut record: *mut cupti::CUpti_Activity = std::ptr::null_mut();
    loop {
        // SAFETY: `buffer` holds `valid` bytes of records CUPTI wrote; `record` walks them (null starts).
        let r = unsafe { cupti::cuptiActivityGetNextRecord(buffer, valid, &mut record) };
        if r != cupti::CUptiResult::CUPTI_SUCCESS {
            break; // CUPTI_ERROR_MAX_LIMIT_REACHED: the end of the buffer
        }
        // Only the fields used are read, each as plain bytes at its offset: the record's enum fields may hold values
        // the bindings do not know (a later CUPTI), which must never be read as Rust enums.
        let base = record as *const u8;
        // SAFETY: every record starts with its kind, a u32.
        let kind = unsafe { std::ptr::read_unaligned(base as *const u32) };
        if kind != cupti::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL as u32 {
            continue;
        }
        type K = cupti::CUpti_ActivityKernel10;
        // SAFETY: a CONCURRENT_KERNEL record of CUPTI 13.x begins with CUpti_ActivityKernel10's layout (checked
        // version; later record versions append fields); packed, so read unaligned.
        let (start_ns, end_ns, stream, name) = unsafe {
            (
                std::ptr::read_unaligned(base.add(std::mem::offset_of!(K, start)) as *const u64),
                std::ptr::read_unaligned(base.add(std::mem::offset_of!(K, end)) as *const u64),
                std::ptr::read_unaligned(base.add(std::mem::offset_of!(K, streamId)) as *const u32),
                std::ptr::read_unaligned(
                    base.add(std::mem::offset_of!(K, name)) as *const *const std::ffi::c_char
                ),
            )
        };
        let name = if name.is_null() {
            "?".to_string()
        } else {
            // SAFETY: CUPTI's kernel names are NUL-terminated strings it owns for the process's life.
            unsafe { std::ffi::CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        };
        out.push(KernelSpan {
            name,
            start_ns,
            end_ns,
            stream,
        });
    }
    out
}

fn check(r: cupti::CUptiResult, what: &str) -> Result<()> {
    ensure!(
        r == cupti::CUptiResult::CUPTI_SUCCESS,
        "CUPTI {what}: {r:?}"
    );
    Ok(())
}

/// Whether CUPTI can be loaded here, and its version is the one the records are parsed for.
fn check_library() -> Result<()> {
    // SAFETY: only tries to open the library.
    ensure!(
        unsafe { cupti::is_culib_present() },
        "libcupti.so.{CUPTI_MAJOR} not found on the library path: add a CUDA {CUPTI_MAJOR} toolkit's \
         extras/CUPTI/lib64, or the copy `scripts/install-nvcc.sh --cupti` installs, to LD_LIBRARY_PATH \
         (gpu-run.sh does so for the bundle's copy)"
    );
    let mut v = 0u32;
    // SAFETY: an out-pointer to a u32.
    check(unsafe { cupti::cuptiGetVersion(&mut v) }, "version")?;
    ensure!(
        v / 10000 == CUPTI_MAJOR,
        "libcupti's API version is {v}; the kernel records are read as CUPTI {CUPTI_MAJOR}.x's"
    );
    Ok(())
}

/// Runs `work` (which must wait for its GPU work before it returns) with CUPTI recording every kernel. `work`
/// runs whether or not this machine can trace: the result is `work`'s, beside the kernels in start order or the
/// reason there are none (no libcupti, a refused trace, no kernel recorded). `work`'s error is returned as is.
pub fn trace_kernels<R>(work: impl FnOnce() -> Result<R>) -> Result<(R, Result<Vec<KernelSpan>>)> {
    let _one = TRACE_LOCK
        .lock()
        .map_err(|_| anyhow!("a kernel trace panicked"))?;
    let kind = cupti::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    let started = start(kind);
    let out = work();
    let spans = started.and_then(|()| finish(kind));
    Ok((out?, spans))
}

/// Loads CUPTI, registers the buffer callbacks (once) and enables the kernel records.
fn start(kind: cupti::CUpti_ActivityKind) -> Result<()> {
    check_library()?;
    CALLBACKS
        .get_or_init(|| {
            // SAFETY: plain function pointers with CUPTI's signatures.
            let r = unsafe {
                cupti::cuptiActivityRegisterCallbacks(
                    Some(buffer_requested),
                    Some(buffer_completed),
                )
            };
            check(r, "register callbacks").map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|e| anyhow!(e))?;
    SPANS
        .lock()
        .map_err(|_| anyhow!("span list poisoned"))?
        .clear();
    // SAFETY: a plain API call.
    check(
        unsafe { cupti::cuptiActivityEnable(kind) },
        "enable kernel records",
    )
}

/// Flushes every buffer (forced: the incomplete ones too), disables the records and returns the spans in start
/// order.
fn finish(kind: cupti::CUpti_ActivityKind) -> Result<Vec<KernelSpan>> {
    // SAFETY: plain API calls.
    let flush = unsafe {
        cupti::cuptiActivityFlushAll(
            cupti::CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED as u32,
        )
    };
    let disable = unsafe { cupti::cuptiActivityDisable(kind) };
    check(flush, "flush")?;
    check(disable, "disable")?;
    let mut spans = std::mem::take(&mut *SPANS.lock().map_err(|_| anyhow!("span list poisoned"))?);
    if spans.is_empty() {
        bail!("CUPTI recorded no kernel (kernel tracing may be unsupported on this machine)");
    }
    spans.sort_by_key(|s| (s.start_ns, s.end_ns));
    Ok(spans)
}

/// A kernel timeline summarized: per kernel name, its launches, its own time, the idle time before its launches
/// (from the latest end of any earlier kernel to its start) and the time it overlapped earlier kernels (PDL, a
/// second stream); and the whole: wall time, busy time (the union of the spans), idle time.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    pub wall_us: f64,
    pub busy_us: f64,
    pub idle_us: f64,
    pub kernels: usize,
    /// Per name, in the order each first ran.
    pub by_name: Vec<NameTime>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct NameTime {
    pub name: String,
    pub launches: usize,
    /// Sum of the spans' own durations.
    pub own_us: f64,
    /// Sum over its launches of the idle time just before it.
    pub idle_before_us: f64,
    /// Sum over its launches of the time it ran beside an earlier kernel.
    pub overlap_us: f64,
}

impl NameTime {
    /// Its share of the wall (its wall advance): the busy time it added (its own time less its overlap) and the idle
    /// time before it. The shares of a timeline add up to its wall.
    pub fn share_us(&self) -> f64 {
        self.own_us - self.overlap_us + self.idle_before_us
    }
}

impl Timeline {
    /// Summarizes spans in start order (as [`trace_kernels`] returns them).
    pub fn of(spans: &[KernelSpan]) -> Timeline {
        let mut by_name: Vec<NameTime> = Vec::new();
        let mut index = std::collections::HashMap::new();
        let (mut busy, mut idle) = (0u64, 0u64);
        for (s, Step { gap, overlap, grow }) in steps(spans) {
            let own = s.end_ns.saturating_sub(s.start_ns);
            busy += grow;
            idle += gap;
            let i = *index.entry(s.name.clone()).or_insert_with(|| {
                by_name.push(NameTime {
                    name: s.name.clone(),
                    launches: 0,
                    own_us: 0.0,
                    idle_before_us: 0.0,
                    overlap_us: 0.0,
                });
                by_name.len() - 1
            });
            let t = &mut by_name[i];
            t.launches += 1;
            t.own_us += own as f64 / 1e3;
            t.idle_before_us += gap as f64 / 1e3;
            t.overlap_us += overlap as f64 / 1e3;
        }
        let wall = spans.first().map_or(0, |first| {
            spans.iter().map(|s| s.end_ns).max().unwrap_or(0) - first.start_ns
        });
        Timeline {
            wall_us: wall as f64 / 1e3,
            busy_us: busy as f64 / 1e3,
            idle_us: idle as f64 / 1e3,
            kernels: spans.len(),
            by_name,
        }
    }
}

/// What one span adds to a timeline walked in start order: the idle time between the latest end so far and its
/// start (`gap`), the time it runs beside earlier kernels (`overlap`), and the busy time it adds (`grow`, its own
/// time less the overlap).
struct Step {
    gap: u64,
    overlap: u64,
    grow: u64,
}

/// The spans in start order, each with its [`Step`].
fn steps(spans: &[KernelSpan]) -> impl Iterator<Item = (&KernelSpan, Step)> {
    let mut frontier: Option<u64> = None; // the latest end so far
    spans.iter().map(move |s| {
        let own = s.end_ns.saturating_sub(s.start_ns);
        let step = match frontier {
            None => Step {
                gap: 0,
                overlap: 0,
                grow: own,
            },
            Some(f) if s.start_ns >= f => Step {
                gap: s.start_ns - f,
                overlap: 0,
                grow: own,
            },
            Some(f) => Step {
                gap: 0,
                overlap: f.min(s.end_ns) - s.start_ns,
                grow: s.end_ns.saturating_sub(f),
            },
        };
        frontier = Some(frontier.map_or(s.end_ns, |f| f.max(s.end_ns)));
        (s, step)
    })
}

/// A traced run's spans attributed to the kernel groups of a profiled run of the same kernels. `order` is every
/// launch the profiled run marked, in order, with its group (`engine::run::ProfiledStep::kernel_groups`;
/// [`LIBRARY_MARK`] for a library call, whose kernels are not marked one by one). Spans are matched to `order` by
/// name in start order; the spans of a library call are those between its neighbours' matches. Each span counts its
/// share of the wall (the busy time it adds and the idle time before it), so the groups add up to the wall.
/// Returns `(group, us, spans)` in the order each group first ran, or `None` when the two runs' kernels do not line
/// up (a different step shape, an emission step against a quiet one).
pub fn by_group(
    spans: &[KernelSpan],
    order: &[(String, String)],
) -> Option<Vec<(String, f64, usize)>> {
    let mut out: Vec<(String, f64, usize)> = Vec::new();
    let mut i = 0;
    for (s, step) in steps(spans) {
        let share = (step.grow + step.gap) as f64 / 1e3;
        let entry = order.get(i)?;
        let group = if entry.0 == LIBRARY_MARK {
            // Library calls (one or several in a row) take the spans until the next marked kernel shows up.
            let next = (i..order.len()).find(|&j| order[j].0 != LIBRARY_MARK);
            match next {
                Some(j) if order[j].0 == s.name => {
                    i = j + 1;
                    &order[j].1
                }
                _ => &entry.1,
            }
        } else if entry.0 == s.name {
            i += 1;
            &entry.1
        } else {
            return None;
        };
        match out.iter_mut().find(|g| &g.0 == group) {
            Some(g) => {
                g.1 += share;
                g.2 += 1;
            }
            None => out.push((group.clone(), share, 1)),
        }
    }
    // Every marked launch matched (library calls at the very end took the spans after the last match).
    order[i..]
        .iter()
        .all(|e| e.0 == LIBRARY_MARK)
        .then_some(out)
}

/// The header of a timeline CSV ([`spans_csv`] writes it, [`parse_spans_csv`] wants it).
const SPANS_CSV_HEADER: &str = "index,name,stream,start_us,end_us,duration_us,idle_before_us";

/// The spans as CSV rows (`index,name,stream,start_us,end_us,duration_us,idle_before_us`), times from the first
/// kernel's start.
pub fn spans_csv(spans: &[KernelSpan]) -> String {
    let mut out = format!("{SPANS_CSV_HEADER}\n");
    let t0 = spans.first().map_or(0, |s| s.start_ns);
    for (i, (s, step)) in steps(spans).enumerate() {
        let idle = step.gap;
        let us = |ns: u64| (ns - t0) as f64 / 1e3;
        out.push_str(&format!(
            "{i},{},{},{:.3},{:.3},{:.3},{:.3}\n",
            s.name,
            s.stream,
            us(s.start_ns),
            us(s.end_ns),
            s.end_ns.saturating_sub(s.start_ns) as f64 / 1e3,
            idle as f64 / 1e3
        ));
    }
    out
}

/// The spans of a `spans_csv` file (`megamoe decode`'s `timeline-*.csv`), in its row order; times in ns from the
/// first kernel's start (the file's microseconds to the nearest nanosecond).
pub fn parse_spans_csv(text: &str) -> Result<Vec<KernelSpan>> {
    let mut lines = text.lines();
    let header = lines.next().unwrap_or_default();
    ensure!(
        header.trim() == SPANS_CSV_HEADER,
        "not a kernel timeline (its header is {header:?}; `megamoe decode` writes timeline-*.csv)"
    );
    let mut spans = Vec::new();
    for (n, line) in lines.enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split(',').collect();
        ensure!(
            f.len() == 7,
            "timeline row {}: {} fields, expected 7",
            n + 1,
            f.len()
        );
        let ns = |v: &str, what: &str| -> Result<u64> {
            let us: f64 = v
                .trim()
                .parse()
                .map_err(|_| anyhow!("timeline row {}: {what} {v:?} is not a number", n + 1))?;
            ensure!(us >= 0.0, "timeline row {}: negative {what} {us}", n + 1);
            Ok((us * 1e3).round() as u64)
        };
        let (start_ns, end_ns) = (ns(f[3], "start_us")?, ns(f[4], "end_us")?);
        ensure!(
            end_ns >= start_ns,
            "timeline row {}: ends before it starts",
            n + 1
        );
        spans.push(KernelSpan {
            name: f[1].to_string(),
            start_ns,
            end_ns,
            stream: f[2].trim().parse().map_err(|_| {
                anyhow!("timeline row {}: stream {:?} is not a number", n + 1, f[2])
            })?,
        });
    }
    ensure!(!spans.is_empty(), "the timeline has no kernels");
    Ok(spans)
}

/// One kernel name's share of the wall in two timelines (an A/B's baseline and candidate); a name missing from one
/// side has 0 launches and 0 us there.
#[derive(Clone, Debug, PartialEq)]
pub struct ShareDelta {
    pub name: String,
    pub launches: (usize, usize),
    pub share_us: (f64, f64),
}

impl ShareDelta {
    pub fn delta_us(&self) -> f64 {
        self.share_us.1 - self.share_us.0
    }
}

/// Per kernel name, the baseline's and the candidate's share of the wall, largest move first (names in the order
/// they first ran break ties). The deltas add up to the difference of the walls.
pub fn share_deltas(base: &Timeline, cand: &Timeline) -> Vec<ShareDelta> {
    let mut out: Vec<ShareDelta> = base
        .by_name
        .iter()
        .map(|n| ShareDelta {
            name: n.name.clone(),
            launches: (n.launches, 0),
            share_us: (n.share_us(), 0.0),
        })
        .collect();
    for n in &cand.by_name {
        match out.iter_mut().find(|d| d.name == n.name) {
            Some(d) => {
                d.launches.1 = n.launches;
                d.share_us.1 = n.share_us();
            }
            None => out.push(ShareDelta {
                name: n.name.clone(),
                launches: (0, n.launches),
                share_us: (0.0, n.share_us()),
            }),
        }
    }
    out.sort_by(|a, b| b.delta_us().abs().total_cmp(&a.delta_us().abs()));
    out
}

/// When both timelines launch the same kernels in the same order (the same step, two builds), each launch's wall
/// advance in each, by launch index; `None` when the sequences differ (a kernel added or removed).
pub fn launch_advances(
    base: &[KernelSpan],
    cand: &[KernelSpan],
) -> Option<Vec<(String, f64, f64)>> {
    if base.len() != cand.len() || base.iter().zip(cand).any(|(a, b)| a.name != b.name) {
        return None;
    }
    let advance = |spans: &[KernelSpan]| -> Vec<f64> {
        steps(spans)
            .map(|(_, st)| (st.grow + st.gap) as f64 / 1e3)
            .collect()
    };
    let (a, b) = (advance(base), advance(cand));
    Some(
        base.iter()
            .zip(a.into_iter().zip(b))
            .map(|(s, (x, y))| (s.name.clone(), x, y))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, start: u64, end: u64) -> KernelSpan {
        KernelSpan {
            name: name.into(),
            start_ns: start,
            end_ns: end,
            stream: 7,
        }
    }

    /// Spans go to the group of the marked launch they match in order; consecutive library calls take the spans
    /// until the next marked kernel; each span counts its busy time added plus the idle time before it, so the groups
    /// add up to the wall; a run whose kernels do not line up gives no table.
    #[test]
    fn traced_spans_fall_into_the_profiled_groups() {
        let g = |k: &str, g: &str| (k.to_string(), g.to_string());
        let lib = LIBRARY_MARK;
        let spans = [
            span("a", 0, 10_000),
            span("b", 12_000, 20_000),
            span("nvjet_1", 20_000, 30_000),
            span("nvjet_2", 29_000, 35_000), // overlaps the one before by 1 us
            span("c", 35_000, 40_000),
            span("nvjet_3", 41_000, 42_000),
        ];
        let order = [
            g("a", "one"),
            g("b", "one"),
            g(lib, "two"),
            g(lib, "two"),
            g("c", "three"),
            g(lib, "four"),
        ];
        let groups = by_group(&spans, &order).unwrap();
        let got: Vec<(&str, f64, usize)> = groups
            .iter()
            .map(|(n, us, k)| (n.as_str(), *us, *k))
            .collect();
        assert_eq!(
            got,
            [
                ("one", 20.0, 2),
                ("two", 15.0, 2),
                ("three", 5.0, 1),
                ("four", 2.0, 1)
            ]
        );
        let wall = Timeline::of(&spans).wall_us;
        assert_eq!(groups.iter().map(|g| g.1).sum::<f64>(), wall);
        // A kernel the profiled run did not launch there, or one it launched that the trace lacks.
        assert!(by_group(&spans, &[g("a", "one"), g("x", "one")]).is_none());
        assert!(by_group(&spans[..2], &order[..3]).is_some());
        assert!(by_group(&spans[..2], &[g("a", "one"), g("b", "one"), g("c", "one")]).is_none());
    }

    /// Gaps count as idle before the kernel that follows them; an overlap (a PDL kernel starting before its
    /// predecessor ends) counts once in busy time and as overlap of the later kernel; a kernel nested inside an
    /// earlier one's span adds nothing to busy time.
    #[test]
    fn a_timeline_splits_wall_time_into_busy_and_idle() {
        let spans = [
            span("a", 1_000, 3_000),   // busy 2 us
            span("b", 4_000, 9_000),   // idle 1 us before, busy 5
            span("a", 8_000, 10_000),  // overlaps b by 1 us, adds 1 busy
            span("c", 8_500, 9_500),   // inside: overlap 1 us, adds nothing
            span("b", 12_000, 13_000), // idle 2 us, busy 1
        ];
        let t = Timeline::of(&spans);
        assert_eq!(t.kernels, 5);
        assert!((t.wall_us - 12.0).abs() < 1e-9);
        assert!((t.busy_us - 9.0).abs() < 1e-9);
        assert!((t.idle_us - 3.0).abs() < 1e-9);
        assert!((t.busy_us + t.idle_us - t.wall_us).abs() < 1e-9);
        let names: Vec<&str> = t.by_name.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        let a = &t.by_name[0];
        assert_eq!(a.launches, 2);
        assert!(
            (a.own_us - 4.0).abs() < 1e-9
                && (a.overlap_us - 1.0).abs() < 1e-9
                && a.idle_before_us == 0.0
        );
        let b = &t.by_name[1];
        assert!((b.own_us - 6.0).abs() < 1e-9 && (b.idle_before_us - 3.0).abs() < 1e-9);
        let c = &t.by_name[2];
        assert!((c.overlap_us - 1.0).abs() < 1e-9 && c.idle_before_us == 0.0);
        let csv = spans_csv(&spans);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 6);
        assert_eq!(lines[2], "1,b,7,3.000,8.000,5.000,1.000");
        assert_eq!(lines[5], "4,b,7,11.000,12.000,1.000,2.000");
    }

    /// A timeline CSV reads back as the spans it was written from (times from the first start); the share deltas of
    /// two timelines add up to the difference of their walls, a kernel on one side only counts 0 on the other, and a
    /// launch-by-launch comparison exists only for the same launches in the same order; bad files are refused.
    #[test]
    fn timeline_csv_round_trips_and_two_steps_compare_by_share() {
        let base = [
            span("a", 1_000, 3_000),
            span("b", 4_000, 9_000),
            span("a", 8_000, 10_000),
        ];
        let back = parse_spans_csv(&spans_csv(&base)).unwrap();
        let shifted: Vec<KernelSpan> = base
            .iter()
            .map(|s| span(&s.name, s.start_ns - 1_000, s.end_ns - 1_000))
            .collect();
        assert_eq!(back, shifted);
        let cand = [
            span("a", 0, 2_000),
            span("b", 2_500, 6_000),
            span("a", 5_000, 7_000),
        ];
        let (ta, tb) = (Timeline::of(&back), Timeline::of(&cand));
        let d = share_deltas(&ta, &tb);
        let sum: f64 = d.iter().map(|x| x.delta_us()).sum();
        assert!((sum - (tb.wall_us - ta.wall_us)).abs() < 1e-9, "{d:?}");
        // b: 1 us idle + 5 us -> 0.5 us idle + 3.5 us, the largest move, listed first.
        assert_eq!(d[0].name, "b");
        assert!((d[0].delta_us() + 2.0).abs() < 1e-9);
        let per_launch = launch_advances(&back, &cand).unwrap();
        assert_eq!(per_launch.len(), 3);
        assert!((per_launch[1].1 - 6.0).abs() < 1e-9 && (per_launch[1].2 - 4.0).abs() < 1e-9);
        let other = [
            span("a", 0, 2_000),
            span("c", 2_000, 3_000),
            span("a", 3_000, 4_000),
        ];
        assert!(launch_advances(&back, &other).is_none());
        let d = share_deltas(&ta, &Timeline::of(&other));
        let c = d.iter().find(|x| x.name == "c").unwrap();
        assert_eq!((c.launches, c.share_us.0), ((0, 1), 0.0));
        assert!(parse_spans_csv("kernel,us\na,1\n").is_err());
        let header = format!("{SPANS_CSV_HEADER}\n");
        assert!(parse_spans_csv(&header).is_err(), "no kernels");
        assert!(
            parse_spans_csv(&format!("{header}0,a,7,2.0,1.0,0,0\n")).is_err(),
            "ends first"
        );
        assert!(
            parse_spans_csv(&format!("{header}0,a,7,x,1.0,0,0\n")).is_err(),
            "not a number"
        );
    }

    /// The fields read from a kernel record sit where CUDA 13.0's cupti_activity.h puts them in
    /// `CUpti_ActivityKernel10` (offsetof printed by gcc from the header of nvidia-cuda-cupti 13.0.85): a change of
    /// the bindings' layout would misread every record.
    #[test]
    fn kernel_record_offsets_are_cupti_13s() {
        type K = cupti::CUpti_ActivityKernel10;
        assert_eq!(std::mem::offset_of!(K, start), 16);
        assert_eq!(std::mem::offset_of!(K, end), 24);
        assert_eq!(std::mem::offset_of!(K, streamId), 48);
        assert_eq!(std::mem::offset_of!(K, name), 104);
        assert_eq!(std::mem::size_of::<K>(), 216);
    }

    #[test]
    fn an_empty_trace_is_an_empty_timeline() {
        let t = Timeline::of(&[]);
        assert_eq!(
            (t.kernels, t.wall_us, t.busy_us, t.idle_us),
            (0, 0.0, 0.0, 0.0)
        );
    }
}
