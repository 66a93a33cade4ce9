//! A progress line on stderr for long sweeps: `[i/total] label msg (elapsed 12.3s, eta 45.6s)`.
//!
//! The estimate assumes the remaining steps take as long, on average, as the finished ones did.

use std::time::{Duration, Instant};

/// Counts finished steps of a known total and prints one line per step to stderr.
#[derive(Debug)]
pub struct Progress {
    label: String,
    total: usize,
    done: usize,
    started: Instant,
}

impl Progress {
    /// Start the clock for `total` steps (0 is allowed; every tick then reports no estimate).
    pub fn new(label: &str, total: usize) -> Progress {
        Progress {
            label: label.to_string(),
            total,
            done: 0,
            started: Instant::now(),
        }
    }

    /// Mark one more step finished and print its line to stderr.
    pub fn tick(&mut self, msg: &str) {
        self.done += 1;
        eprintln!("{}", self.line(msg, self.started.elapsed()));
    }

    /// Steps finished so far.
    pub fn done(&self) -> usize {
        self.done
    }

    /// The line for the current count after `elapsed` time.
    fn line(&self, msg: &str, elapsed: Duration) -> String {
        let eta = if self.done == 0 || self.done > self.total {
            // Nothing to extrapolate from, or more ticks than announced: no honest estimate.
            "?".to_string()
        } else {
            let per_step = elapsed.as_secs_f64() / self.done as f64;
            format_seconds(per_step * (self.total - self.done) as f64)
        };
        let msg = if msg.is_empty() {
            String::new()
        } else {
            format!(" {msg}")
        };
        format!(
            "[{}/{}] {}{msg} (elapsed {}, eta {eta})",
            self.done,
            self.total,
            self.label,
            format_seconds(elapsed.as_secs_f64())
        )
    }
}

/// `4.2s`, `3m05s`, `1h02m` — short enough for a progress line.
fn format_seconds(secs: f64) -> String {
    if secs < 60.0 {
        format!("{secs:.1}s")
    } else if secs < 3600.0 {
        let s = secs.round() as u64;
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        let m = (secs / 60.0).round() as u64;
        format!("{}h{:02}m", m / 60, m % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_counts_and_extrapolates() {
        let mut p = Progress::new("copy", 4);
        assert_eq!(
            p.line("", Duration::ZERO),
            "[0/4] copy (elapsed 0.0s, eta ?)"
        );
        p.done = 1;
        // 1 step in 10 s -> 3 more steps ~ 30 s.
        assert_eq!(
            p.line("bytes=1048576", Duration::from_secs(10)),
            "[1/4] copy bytes=1048576 (elapsed 10.0s, eta 30.0s)"
        );
        p.done = 4;
        assert_eq!(
            p.line("x", Duration::from_secs(125)),
            "[4/4] copy x (elapsed 2m05s, eta 0.0s)"
        );
        p.done = 5;
        assert!(p.line("x", Duration::from_secs(1)).ends_with("eta ?)"));
    }

    #[test]
    fn durations() {
        assert_eq!(format_seconds(4.24), "4.2s");
        assert_eq!(format_seconds(185.0), "3m05s");
        assert_eq!(format_seconds(3720.0), "1h02m");
    }

    #[test]
    fn tick_counts() {
        let mut p = Progress::new("t", 2);
        p.tick("a");
        p.tick("b");
        assert_eq!(p.done(), 2);
    }
}
