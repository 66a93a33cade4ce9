//! CSV files of [`Row`]s: the one on-disk format of every measurement.
//!
//! A file is the header [`Row::COLUMNS`] followed by one line per row; empty cells are `None`.
//! Floats are written in Rust's shortest round-trip form, so reading a file back gives the
//! same values bit for bit.

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::row::Row;

/// Write `rows` to `path`, replacing any existing file; creates missing parent directories.
/// The header is written even when `rows` is empty.
pub fn write_rows(path: &Path, rows: &[Row]) -> Result<()> {
    create_parent_dirs(path)?;
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    write_records(file, rows, true).with_context(|| format!("writing {}", path.display()))
}

/// Append `rows` to `path`. A missing or empty file is created with the header first; an existing
/// file must start with exactly the current header, so rows of an older schema are never mixed in.
pub fn append_rows(path: &Path, rows: &[Row]) -> Result<()> {
    let has_content = path.exists()
        && fs::metadata(path)
            .with_context(|| format!("reading metadata of {}", path.display()))?
            .len()
            > 0;
    if !has_content {
        return write_rows(path, rows);
    }
    check_header(path)?;
    let file = OpenOptions::new()
        .append(true)
        .open(path)
        .with_context(|| format!("opening {} for appending", path.display()))?;
    write_records(file, rows, false).with_context(|| format!("appending to {}", path.display()))
}

/// Read every row of a CSV file written by [`write_rows`] / [`append_rows`]. Errors name the file
/// and the record that failed to parse, and reject a header that is not [`Row::COLUMNS`].
pub fn read_rows(path: &Path) -> Result<Vec<Row>> {
    check_header(path)?;
    let mut reader =
        csv::Reader::from_path(path).with_context(|| format!("opening {}", path.display()))?;
    let mut rows = Vec::new();
    for (index, record) in reader.deserialize::<Row>().enumerate() {
        // Line numbers: the header is line 1, so record `index` sits on line index + 2
        // (no field in this schema contains a newline).
        let row = record.with_context(|| {
            format!("{}: cannot parse row on line {}", path.display(), index + 2)
        })?;
        rows.push(row);
    }
    Ok(rows)
}

fn create_parent_dirs(path: &Path) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).with_context(|| format!("creating directory {}", dir.display()))?;
    }
    Ok(())
}

fn write_records(file: File, rows: &[Row], with_header: bool) -> Result<()> {
    // The header is written by hand rather than by serde so that an empty file still gets one.
    let mut writer = csv::WriterBuilder::new()
        .has_headers(false)
        .from_writer(file);
    if with_header {
        writer.write_record(Row::COLUMNS)?;
    }
    for row in rows {
        writer.serialize(row)?;
    }
    writer.flush()?;
    Ok(())
}

fn check_header(path: &Path) -> Result<()> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut first_line = String::new();
    BufReader::new(file)
        .read_line(&mut first_line)
        .with_context(|| format!("reading the header of {}", path.display()))?;
    let found = first_line.trim_end_matches(['\r', '\n']);
    let expected = Row::COLUMNS.join(",");
    if found != expected {
        bail!(
            "{} does not have the megamoe row header.\n  expected: {expected}\n  found:    {found}",
            path.display()
        );
    }
    Ok(())
}
