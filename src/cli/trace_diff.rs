//! `megamoe trace-diff`: two traced steps side by side, by each kernel's share of the wall (gpu::trace).

use std::path::Path;

use anyhow::{Context, Result};

use crate::gpu::trace::{launch_advances, parse_spans_csv, share_deltas, Timeline};

pub fn run(base: &Path, candidate: &Path, top: usize) -> Result<()> {
    let read = |p: &Path| -> Result<_> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        parse_spans_csv(&text).with_context(|| format!("parsing {}", p.display()))
    };
    let (a, b) = (read(base)?, read(candidate)?);
    let (ta, tb) = (Timeline::of(&a), Timeline::of(&b));
    println!("base      {} ({} kernels)", base.display(), ta.kernels);
    println!("candidate {} ({} kernels)", candidate.display(), tb.kernels);
    println!(
        "wall {:.1} -> {:.1} us ({:+.1}); idle {:.1} -> {:.1} us",
        ta.wall_us,
        tb.wall_us,
        tb.wall_us - ta.wall_us,
        ta.idle_us,
        tb.idle_us
    );
    println!("\nshare of the wall by kernel (the busy time it added and the idle time before it), largest move first:");
    println!(
        "{:<52} {:>9} {:>10} {:>10} {:>8} {:>10}",
        "kernel", "launches", "base us", "cand us", "delta", "per launch"
    );
    let deltas = share_deltas(&ta, &tb);
    for d in deltas.iter().take(top) {
        let name: String = d.name.chars().take(52).collect();
        let launches = if d.launches.0 == d.launches.1 {
            d.launches.0.to_string()
        } else {
            format!("{}->{}", d.launches.0, d.launches.1)
        };
        println!(
            "{name:<52} {launches:>9} {:>10.1} {:>10.1} {:>+8.1} {:>+10.2}",
            d.share_us.0,
            d.share_us.1,
            d.delta_us(),
            d.delta_us() / d.launches.0.max(d.launches.1).max(1) as f64
        );
    }
    if deltas.len() > top {
        let rest: f64 = deltas[top..].iter().map(|d| d.delta_us()).sum();
        println!(
            "({} more kernels, {rest:+.1} us together; --top to see them)",
            deltas.len() - top
        );
    }
    match launch_advances(&a, &b) {
        Some(rows) => {
            let mut moved: Vec<(usize, &(String, f64, f64))> = rows.iter().enumerate().collect();
            moved.sort_by(|x, y| (y.1 .2 - y.1 .1).abs().total_cmp(&(x.1 .2 - x.1 .1).abs()));
            println!(
                "\nthe same launches in the same order; the launches whose advance moved most:"
            );
            println!(
                "{:>6} {:<52} {:>9} {:>9} {:>8}",
                "index", "kernel", "base us", "cand us", "delta"
            );
            for (i, (name, x, y)) in moved.into_iter().take(top) {
                let name: String = name.chars().take(52).collect();
                println!("{i:>6} {name:<52} {x:>9.2} {y:>9.2} {:>+8.2}", y - x);
            }
        }
        None => println!(
            "\n(the two steps launch different kernels, so no launch-by-launch comparison)"
        ),
    }
    Ok(())
}
