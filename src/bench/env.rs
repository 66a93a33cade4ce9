//! Provenance of a run: which code (git commit) and when (UTC timestamp).

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// Environment variable that names the commit explicitly. The GPU machine runs binaries copied from
/// the dev machine and has no git checkout, so the bundle script sets this.
pub const GIT_COMMIT_ENV: &str = "MEGAMOE_GIT_COMMIT";

/// The commit the measured code was built from: `$MEGAMOE_GIT_COMMIT` when set and non-empty, else the
/// `COMMIT` file that scripts/gpu-bundle.sh writes next to the binary, else `git rev-parse --short HEAD` in the
/// current directory, else `"unknown"`. (The bundle file comes before git because the GPU machine's copy of
/// the tree may carry an older checkout than the one the binary was built from.)
pub fn git_commit() -> String {
    let from_env = std::env::var(GIT_COMMIT_ENV).ok();
    resolve_git_commit(from_env.as_deref(), || {
        bundle_commit().or_else(git_rev_parse)
    })
}

/// `COMMIT` next to the running executable: first line the short hash, an optional `+dirty` line after it.
fn bundle_commit() -> Option<String> {
    let path = std::env::current_exe().ok()?.with_file_name("COMMIT");
    let text = std::fs::read_to_string(path).ok()?;
    let commit: String = text.lines().map(str::trim).collect();
    (!commit.is_empty()).then_some(commit)
}

/// The selection rule of [`git_commit`], with the two sources passed in so it can be tested.
fn resolve_git_commit(from_env: Option<&str>, from_git: impl FnOnce() -> Option<String>) -> String {
    if let Some(commit) = from_env.map(str::trim).filter(|c| !c.is_empty()) {
        return commit.to_string();
    }
    from_git().unwrap_or_else(|| "unknown".to_string())
}

fn git_rev_parse() -> Option<String> {
    let output = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let commit = String::from_utf8(output.stdout).ok()?.trim().to_string();
    (!commit.is_empty()).then_some(commit)
}

/// The current time as RFC 3339 UTC with whole seconds, e.g. `2026-12-02T12:22:56Z`.
pub fn timestamp_utc() -> String {
    // A clock before 1970 is a broken machine; print the epoch rather than fail a benchmark over it.
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339_from_unix_seconds(secs)
}

/// Format seconds since 1970-01-01T00:00:00Z as RFC 3339 UTC. Unix time has no leap seconds, so
/// every day is exactly 86 400 s and the calendar date follows from whole days alone.
pub fn rfc3339_from_unix_seconds(secs: u64) -> String {
    let mut days = secs / 86_400;
    let second_of_day = secs % 86_400;
    let (hour, minute, second) = (
        second_of_day / 3600,
        (second_of_day % 3600) / 60,
        second_of_day % 60,
    );

    // Walk whole years, then whole months. At most a few hundred iterations for any real date,
    // and plainly correct, which matters more here than speed.
    let mut year = 1970u64;
    loop {
        let year_len = if is_leap_year(year) { 366 } else { 365 };
        if days < year_len {
            break;
        }
        days -= year_len;
        year += 1;
    }
    let month_lengths = [
        31,
        if is_leap_year(year) { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    let mut month = 1;
    for len in month_lengths {
        if days < len {
            break;
        }
        days -= len;
        month += 1;
    }
    let day = days + 1;
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z")
}

/// Gregorian rule: every 4th year, except centuries, except every 4th century.
fn is_leap_year(year: u64) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_instants() {
        // Reference values computed independently (`date -u -d @SECS`).
        let cases = [
            (0, "1970-01-01T00:00:00Z"),
            (86_399, "1970-01-01T23:59:59Z"),
            (951_782_400, "2000-02-29T00:00:00Z"), // 2000 is a leap year (divisible by 400)
            (951_868_800, "2000-03-01T00:00:00Z"),
            (1_700_000_000, "2023-11-14T22:13:20Z"),
            (4_107_542_400, "2100-03-01T00:00:00Z"), // 2100 is not: Feb 28 is followed by Mar 1
            (1_798_761_599, "2026-12-31T23:59:59Z"),
        ];
        for (secs, want) in cases {
            assert_eq!(rfc3339_from_unix_seconds(secs), want, "secs={secs}");
        }
    }

    #[test]
    fn now_is_well_formed() {
        let ts = timestamp_utc();
        let b = ts.as_bytes();
        assert_eq!(ts.len(), 20, "{ts}");
        assert_eq!(
            (b[4], b[7], b[10], b[13], b[16], b[19]),
            (b'-', b'-', b'T', b':', b':', b'Z')
        );
        assert!(ts.as_str() >= "2024", "clock says {ts}");
    }

    #[test]
    fn commit_source_order() {
        assert_eq!(
            resolve_git_commit(Some("abc1234"), || panic!("git not consulted")),
            "abc1234"
        );
        assert_eq!(
            resolve_git_commit(Some("  "), || Some("def5678".into())),
            "def5678"
        );
        assert_eq!(
            resolve_git_commit(None, || Some("def5678".into())),
            "def5678"
        );
        assert_eq!(resolve_git_commit(None, || None), "unknown");
        assert!(!git_commit().is_empty());
    }
}
