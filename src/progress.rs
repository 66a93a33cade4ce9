//! Progress of long sweeps and stress runs on stderr, through `indicatif`. A leaf module (it uses nothing
//! of the crate), so the bench runner and the ops' stress suites share it without an upward import.
//!
//! On a terminal: one bar that redraws in place, with the step count, the rate, the estimated time left
//! and the current step's text. When stderr is not a terminal (CI, the GPU machine logging to a file) a
//! redrawn bar would fill the log with control codes, so each step prints one plain line instead:
//! `[3/40] bench moe_gemm_l1 nvfp4 tokens=64 (elapsed 12s, 0.25/s, eta 2m 28s)`. Rate and estimate are
//! indicatif's in both cases (a weighted average of recent steps).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{HumanDuration, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Counts finished steps of a known total and shows them on stderr.
#[derive(Debug)]
pub struct Progress {
    label: String,
    bar: ProgressBar,
    /// True when the bar is drawn on a terminal; false: one plain line per step.
    live: bool,
}

impl Progress {
    /// Start the clock for `total` steps (0 is allowed; every step then reports no estimate).
    pub fn new(label: &str, total: usize) -> Progress {
        Self::with_terminal(label, total, std::io::stderr().is_terminal())
    }

    fn with_terminal(label: &str, total: usize, live: bool) -> Progress {
        let target = if live {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total as u64), target);
        // The template is a constant: a parse failure is a bug caught by the unit test below.
        let style = ProgressStyle::with_template(
            "{prefix} [{bar:30.cyan/blue}] {pos}/{len} ({per_sec}, eta {eta}) {wide_msg}",
        )
        .expect("progress template")
        .progress_chars("=> ");
        bar.set_style(style);
        bar.set_prefix(label.to_string());
        if live {
            bar.enable_steady_tick(Duration::from_millis(250));
        }
        Progress {
            label: label.to_string(),
            bar,
            live,
        }
    }

    /// Mark one more step finished, `msg` naming it (on a terminal the bar shows it; otherwise one line).
    pub fn tick(&mut self, msg: &str) {
        self.bar.inc(1);
        if self.live {
            self.bar.set_message(msg.to_string());
            if self.done() == self.total() {
                self.bar.finish();
            }
        } else {
            eprintln!("{}", self.line(msg));
        }
    }

    /// Print `text` on its own line above the bar (or as a plain line when there is no bar).
    pub fn println(&self, text: &str) {
        if self.live {
            self.bar.println(text);
        } else {
            eprintln!("{text}");
        }
    }

    /// Steps finished so far.
    pub fn done(&self) -> usize {
        self.bar.position() as usize
    }

    fn total(&self) -> usize {
        self.bar.length().unwrap_or(0) as usize
    }

    /// The plain line for the current count.
    fn line(&self, msg: &str) -> String {
        let (done, total) = (self.done(), self.total());
        let eta = if done == 0 || done > total {
            // Nothing to extrapolate from, or more steps than announced: no honest estimate.
            "?".to_string()
        } else {
            HumanDuration(self.bar.eta()).to_string()
        };
        let msg = if msg.is_empty() {
            String::new()
        } else {
            format!(" {msg}")
        };
        format!(
            "[{done}/{total}] {}{msg} (elapsed {}, {:.2}/s, eta {eta})",
            self.label,
            HumanDuration(self.bar.elapsed()),
            self.bar.per_sec(),
        )
    }
}

impl Drop for Progress {
    /// A run stopped early leaves the bar where it got to instead of erasing it.
    fn drop(&mut self) {
        if !self.bar.is_finished() {
            self.bar.abandon();
        }
    }
}

/// Set by the SIGINT handler [`catch_interrupt`] installs.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigint(_sig: i32) {
    // Only an atomic store: async-signal-safe.
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// From now on, Ctrl-C (SIGINT) sets a flag ([`interrupted`]) instead of killing the process, so a long run
/// stops at the end of its current step with its results written. A second Ctrl-C still stops it at once (the
/// handler is reset to the default after the first).
pub fn catch_interrupt() {
    extern "C" {
        fn signal(signum: i32, handler: usize) -> usize;
    }
    const SIGINT: i32 = 2;
    // SAFETY: `signal` from the C library the standard library links; the handler only stores an atomic. The
    // one-shot reset comes from re-installing SIG_DFL (0) inside a wrapper.
    extern "C" fn once(sig: i32) {
        on_sigint(sig);
        unsafe { signal(SIGINT, 0) };
    }
    unsafe {
        signal(SIGINT, once as *const () as usize);
    }
}

/// Whether Ctrl-C was pressed since [`catch_interrupt`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_count_and_estimate() {
        let mut p = Progress::with_terminal("copy", 4, false);
        let first = p.line("");
        assert!(first.starts_with("[0/4] copy (elapsed "), "{first}");
        assert!(first.ends_with("eta ?)"), "{first}");
        p.tick("bytes=1048576");
        let line = p.line("bytes=1048576");
        assert!(
            line.starts_with("[1/4] copy bytes=1048576 (elapsed "),
            "{line}"
        );
        assert!(
            line.contains("/s, eta ") && !line.ends_with("eta ?)"),
            "{line}"
        );
        for _ in 0..4 {
            p.tick("x");
        }
        assert_eq!(p.done(), 5);
        assert!(p.line("x").ends_with("eta ?)"), "more steps than announced");
    }

    #[test]
    fn live_bar_counts_and_finishes() {
        // A live bar drawing into a hidden target: the same state without writing to the test's stderr.
        let mut p = Progress::with_terminal("t", 2, false);
        p.live = true;
        p.bar.set_draw_target(ProgressDrawTarget::hidden());
        p.tick("a");
        assert!(!p.bar.is_finished());
        p.tick("b");
        assert_eq!(p.done(), 2);
        assert!(p.bar.is_finished(), "the last step finishes the bar");
    }
}
