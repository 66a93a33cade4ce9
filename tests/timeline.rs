//! The kernel timeline (src/gpu/trace.rs, CUPTI's kernel records) against work whose kernels are known: a
//! captured graph of L2-flush reads (a memset node and one `l2_flush_read` kernel each), replayed while tracing.
//! The trace must list exactly the graph's kernels, by name, in stream order, each inside the replay's event-timed
//! interval; the memset nodes are not kernels and must not appear.

mod common;

use megamoe::gpu::marks::EventMarks;
use megamoe::gpu::timing::{capture_on, graph_kernel_count, L2Flush};
use megamoe::gpu::trace::{trace_kernels, Timeline};

const FLUSHES: usize = 5;

#[test]
#[ignore = "needs an H100/H200"]
fn a_traced_graph_replay_lists_its_kernels_in_stream_order() {
    let gpu = common::gpu("a_traced_graph_replay_lists_its_kernels_in_stream_order");
    let stream = gpu.stream.clone();
    let mut flush = L2Flush::new(&gpu).unwrap();
    // One eager flush loads the module (a capture must not).
    flush.flush(&stream).unwrap();
    stream.synchronize().unwrap();
    let marks = EventMarks::new(&stream);
    let ((), spans) = trace_kernels(|| {
        let graph = capture_on(&stream, || {
            for _ in 0..FLUSHES {
                flush.flush(&stream)?;
            }
            Ok(())
        })?;
        assert_eq!(graph_kernel_count(&graph)?, FLUSHES);
        marks.mark(&stream, "start")?;
        graph
            .launch()
            .map_err(|e| anyhow::anyhow!("launch: {e:?}"))?;
        marks.mark(&stream, "replay")?;
        stream
            .synchronize()
            .map_err(|e| anyhow::anyhow!("sync: {e:?}"))
    })
    .unwrap();
    let spans = spans.unwrap_or_else(|e| panic!("this machine could not trace kernels: {e:#}"));
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, vec!["l2_flush_read"; FLUSHES], "{spans:#?}");
    for s in &spans {
        assert!(s.end_ns > s.start_ns, "an empty span: {s:?}");
    }
    // One stream, no PDL: each read starts after the one before it ends (its memset runs between them).
    for w in spans.windows(2) {
        assert!(w[1].start_ns >= w[0].end_ns, "overlapping spans: {w:?}");
    }
    let t = Timeline::of(&spans);
    let replay_us = marks.durations().unwrap()[0].1;
    // The kernels ran inside the replay: their wall time fits in its event interval (1 us for the two clocks'
    // resolutions), and on one stream the busy time is the sum of the spans.
    assert!(
        t.wall_us <= replay_us + 1.0,
        "traced wall {:.1} us > event-timed replay {replay_us:.1} us",
        t.wall_us
    );
    let own: f64 = t.by_name.iter().map(|n| n.own_us).sum();
    assert!((t.busy_us - own).abs() < 1e-6 && t.idle_us > 0.0, "{t:?}");
    println!(
        "{FLUSHES} flushes: replay {replay_us:.1} us (events), traced wall {:.1} us, busy {:.1}, idle {:.1} (the \
         memsets between the reads)",
        t.wall_us, t.busy_us, t.idle_us
    );
}
