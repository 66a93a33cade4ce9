//! Launching the ranks of an expert-parallel run (docs/multi-gpu.md, "Launch"): one process per GPU. The parent
//! touches no GPU beyond counting them: it checks that the machine has the GPUs, makes NCCL loadable, creates the
//! NCCL unique id, spawns one copy of itself per rank with the rank's environment ([`child_env`]), prefixes each
//! child's output with its rank, waits on all of them by pid and stops the others (by their pids) if one fails.
//!
//! The environment of rank r of N: `MEGAMOE_RANK=r`, `MEGAMOE_WORLD=N`, `MEGAMOE_NCCL_ID=<hex of the 128-byte id>`,
//! `CUDA_VISIBLE_DEVICES=r` (the rank opens its GPU as device 0), `NCCL_NVLS_ENABLE=0` (always: NVLink SHARP
//! multicast is off on the lent machines; a user's other value is overridden, with a note). An external launcher may
//! set the same variables, or torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK` with the id in `MEGAMOE_NCCL_ID`
//! ([`RankEnv`]).

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};

use crate::dist::comm::{self, id_from_hex, id_to_hex, NCCL_ID_BYTES};

pub const ENV_RANK: &str = "MEGAMOE_RANK";
pub const ENV_WORLD: &str = "MEGAMOE_WORLD";
pub const ENV_NCCL_ID: &str = "MEGAMOE_NCCL_ID";
pub const ENV_NVLS: &str = "NCCL_NVLS_ENABLE";
pub const ENV_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// Set by the parent on its own re-exec once it has linked a versioned-only `libnccl.so.2` into a private folder on
/// `LD_LIBRARY_PATH` (the folder's path), so it never loops.
pub const ENV_NCCL_SHIM: &str = "MEGAMOE_NCCL_SHIM";

/// What a rank process reads from its environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    /// The GPU ordinal to open: 0 under megamoe's launcher (`CUDA_VISIBLE_DEVICES` names one GPU), `LOCAL_RANK`
    /// under torchrun's variables.
    pub device: usize,
    /// The NCCL id (required when `world > 1`).
    pub nccl_id: Option<[u8; NCCL_ID_BYTES]>,
}

impl RankEnv {
    /// The rank's environment from `var` (a lookup: `std::env::var` in [`RankEnv::from_env`], a map in tests):
    /// `None` when neither `MEGAMOE_RANK` nor torchrun's `RANK` is set (not a rank process). Errors name the bad
    /// variable.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<RankEnv>> {
        let num = |name: &str| -> Result<Option<usize>> {
            var(name)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| anyhow!("{name}={v:?} is not a non-negative integer"))
                })
                .transpose()
        };
        let (rank, world, device) = if let Some(rank) = num(ENV_RANK)? {
            let world = num(ENV_WORLD)?
                .ok_or_else(|| anyhow!("{ENV_RANK} is set but {ENV_WORLD} is not"))?;
            (rank, world, 0)
        } else if let Some(rank) = num("RANK")? {
            let world =
                num("WORLD_SIZE")?.ok_or_else(|| anyhow!("RANK is set but WORLD_SIZE is not"))?;
            (rank, world, num("LOCAL_RANK")?.unwrap_or(0))
        } else {
            return Ok(None);
        };
        ensure!(world >= 1, "a world of 0 ranks");
        ensure!(rank < world, "rank {rank} outside a world of {world}");
        let nccl_id = match var(ENV_NCCL_ID) {
            Some(h) => Some(id_from_hex(&h).context(ENV_NCCL_ID)?),
            None => None,
        };
        ensure!(
            world == 1 || nccl_id.is_some(),
            "rank {rank} of {world}: {ENV_NCCL_ID} is not set (the parent's NCCL unique id)"
        );
        Ok(Some(RankEnv {
            rank,
            world,
            device,
            nccl_id,
        }))
    }

    /// [`RankEnv::from_vars`] of this process's environment.
    pub fn from_env() -> Result<Option<RankEnv>> {
        RankEnv::from_vars(|n| std::env::var(n).ok())
    }
}

/// The environment rank `rank` of `world` gets (module docs), and a note when the user's `NCCL_NVLS_ENABLE`
/// (`user_nvls`) is overridden.
pub fn child_env(
    rank: usize,
    world: usize,
    id: &[u8; NCCL_ID_BYTES],
    user_nvls: Option<&str>,
) -> (Vec<(String, String)>, Option<String>) {
    let env = vec![
        (ENV_RANK.to_string(), rank.to_string()),
        (ENV_WORLD.to_string(), world.to_string()),
        (ENV_NCCL_ID.to_string(), id_to_hex(id)),
        (ENV_DEVICES.to_string(), rank.to_string()),
        (ENV_NVLS.to_string(), "0".to_string()),
    ];
    let note = user_nvls.filter(|v| v.trim() != "0").map(|v| {
        format!("{ENV_NVLS}={v} is overridden: the ranks run with {ENV_NVLS}=0 (NVLink multicast stays off)")
    });
    (env, note)
}

/// Checks of `--ranks` that need no GPU: at least one rank, and the routed experts split evenly in contiguous
/// blocks (`ExpertPartition`).
pub fn check_ranks(ranks: usize, experts: usize) -> Result<()> {
    ensure!(ranks >= 1, "--ranks must be at least 1");
    crate::engine::ep::ExpertPartition::new(experts, ranks)
        .map(|_| ())
        .with_context(|| format!("--ranks {ranks}"))
}

/// The GPUs this process can see (a driver call, no context): 0 with the reason when there is no driver.
pub fn count_gpus() -> (usize, Option<String>) {
    if let Some(why) = crate::gpu::probe_error() {
        return (0, Some(why));
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) => (n.max(0) as usize, None),
        Err(e) => (0, Some(format!("cuDeviceGetCount failed: {e:?}"))),
    }
}

/// `Ok` when a machine with `gpus` GPUs (`why`: the reason there are none) can run `ranks` ranks, else the error a
/// user reads before any GPU work.
pub fn check_gpus(ranks: usize, gpus: usize, why: Option<&str>) -> Result<()> {
    if ranks <= gpus {
        return Ok(());
    }
    match why {
        Some(why) => bail!("--ranks {ranks} needs {ranks} GPUs, one per rank; this machine has none ({why})"),
        None => bail!(
            "--ranks {ranks} needs {ranks} GPUs, one per rank; this machine has {gpus} (use --ranks {} or fewer)",
            gpus.max(1)
        ),
    }
}

/// Makes NCCL loadable for this process and its children: nothing when cudarc can open it; else, when a
/// `libnccl.so.2` exists ([`comm::nccl_library_candidates`]), links it as `libnccl.so` in a private folder and
/// re-executes this process with that folder first on `LD_LIBRARY_PATH` (the loader reads it at start), which the
/// children inherit. Returns only when NCCL is loadable, or with an error.
pub fn make_nccl_loadable() -> Result<()> {
    if comm::nccl_loadable() {
        return Ok(());
    }
    if std::env::var_os(ENV_NCCL_SHIM).is_some() {
        return comm::nccl_check();
    }
    let Some(lib) = comm::nccl_library_candidates()
        .into_iter()
        .find(|p| p.is_file())
    else {
        return comm::nccl_check();
    };
    let dir = std::env::temp_dir().join(format!("megamoe-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link)
        .with_context(|| format!("linking {} to {}", link.display(), lib.display()))?;
    let mut path = OsString::from(dir.as_os_str());
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let exe = std::env::current_exe().context("finding this executable to re-run it")?;
    eprintln!(
        "NCCL: cudarc opens libnccl.so; linking it to {} in {} and re-running",
        lib.display(),
        dir.display()
    );
    use std::os::unix::process::CommandExt;
    let err = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", path)
        .env(ENV_NCCL_SHIM, &dir)
        .exec();
    Err(anyhow!("re-running with NCCL on LD_LIBRARY_PATH: {err}"))
}

/// The parent of a `ranks`-rank run: checks the GPUs (before any GPU work), makes NCCL loadable, creates the id,
/// runs this executable with `args` once per rank with [`child_env`], prefixes each line of a rank's output with
/// `[rank r]`, waits for all, and stops the others by pid as soon as one fails. `ranks == 1` is not launched here
/// (the caller runs it in process).
pub fn launch(ranks: usize, args: &[OsString]) -> Result<()> {
    ensure!(ranks >= 2, "launch: {ranks} rank(s) run in this process");
    let (gpus, why) = count_gpus();
    check_gpus(ranks, gpus, why.as_deref())?;
    make_nccl_loadable()?;
    eprintln!(
        "expert parallelism: {ranks} ranks on {gpus} GPUs, NCCL {}",
        comm::nccl_version()?
    );
    let id = comm::new_id()?;
    let user_nvls = std::env::var(ENV_NVLS).ok();
    let exe = std::env::current_exe().context("finding this executable to run the ranks")?;
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(ranks);
    let mut printers = Vec::new();
    let out_lock = Arc::new(Mutex::new(()));
    for rank in 0..ranks {
        let (env, note) = child_env(rank, ranks, &id, user_nvls.as_deref());
        if let (0, Some(n)) = (rank, note) {
            eprintln!("{n}");
        }
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut children);
                bail!("starting rank {rank}: {e}");
            }
        };
        for (pipe, to_err) in [
            (
                child
                    .stdout
                    .take()
                    .map(|p| Box::new(p) as Box<dyn Read + Send>),
                false,
            ),
            (
                child
                    .stderr
                    .take()
                    .map(|p| Box::new(p) as Box<dyn Read + Send>),
                true,
            ),
        ] {
            if let Some(pipe) = pipe {
                let lock = out_lock.clone();
                printers.push(std::thread::spawn(move || {
                    prefix_lines(rank, pipe, to_err, &lock)
                }));
            }
        }
        children.push((rank, child));
    }
    let failed = wait_all(&mut children);
    for p in printers {
        let _ = p.join();
    }
    match failed {
        None => Ok(()),
        Some((rank, status)) => {
            bail!("rank {rank} failed ({status}); the other ranks were stopped")
        }
    }
}

/// Copies `pipe` line by line to the parent's stdout or stderr, each line prefixed with `[rank r]`.
fn prefix_lines(rank: usize, pipe: Box<dyn Read + Send>, to_err: bool, lock: &Mutex<()>) {
    for line in BufReader::new(pipe).lines().map_while(|l| l.ok()) {
        let _g = lock.lock();
        if to_err {
            eprintln!("[rank {rank}] {line}");
        } else {
            println!("[rank {rank}] {line}");
        }
    }
}

/// Waits for every child (polling each by pid); when one exits unsuccessfully, stops the others and returns it.
fn wait_all(children: &mut [(usize, Child)]) -> Option<(usize, String)> {
    let mut done: HashMap<usize, bool> = HashMap::new();
    loop {
        for (rank, child) in children.iter_mut() {
            if done.contains_key(rank) {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) if status.success() => {
                    done.insert(*rank, true);
                }
                Ok(Some(status)) => {
                    let rank = *rank;
                    stop_all(children);
                    return Some((rank, status.to_string()));
                }
                Ok(None) => {}
                Err(e) => {
                    let rank = *rank;
                    stop_all(children);
                    return Some((rank, format!("waiting on it failed: {e}")));
                }
            }
        }
        if done.len() == children.len() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stops every child still running (each by its own pid) and reaps it.
fn stop_all(children: &mut [(usize, Child)]) {
    for (_, child) in children.iter_mut() {
        if let Ok(None) = child.try_wait() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn a_child_gets_its_rank_world_id_one_gpu_and_nvls_off() {
        let id: [u8; NCCL_ID_BYTES] = std::array::from_fn(|i| (i * 7) as u8);
        let (env, note) = child_env(2, 4, &id, None);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(get(ENV_RANK).as_deref(), Some("2"));
        assert_eq!(get(ENV_WORLD).as_deref(), Some("4"));
        assert_eq!(get(ENV_DEVICES).as_deref(), Some("2"));
        assert_eq!(get(ENV_NVLS).as_deref(), Some("0"));
        assert_eq!(id_from_hex(&get(ENV_NCCL_ID).unwrap()).unwrap(), id);
        assert_eq!(env.len(), 5);
        assert!(note.is_none());
        // A user's NVLS setting is overridden, and said so; "0" needs no note.
        let (env, note) = child_env(0, 2, &id, Some("1"));
        assert!(env.contains(&(ENV_NVLS.to_string(), "0".to_string())));
        assert!(note.unwrap().contains("NCCL_NVLS_ENABLE=1 is overridden"));
        assert!(child_env(0, 2, &id, Some("0")).1.is_none());
        // What the child reads back is what the parent wrote.
        let (env, _) = child_env(3, 4, &id, None);
        let got = RankEnv::from_vars(|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
            .unwrap()
            .unwrap();
        assert_eq!(
            got,
            RankEnv {
                rank: 3,
                world: 4,
                device: 0,
                nccl_id: Some(id)
            }
        );
    }

    #[test]
    fn rank_environment_is_read_or_refused_with_the_variable_named() {
        assert_eq!(RankEnv::from_vars(vars(&[])).unwrap(), None);
        let one = RankEnv::from_vars(vars(&[(ENV_RANK, "0"), (ENV_WORLD, "1")]))
            .unwrap()
            .unwrap();
        assert_eq!((one.rank, one.world, one.nccl_id), (0, 1, None));
        let hex = id_to_hex(&[0xAB; NCCL_ID_BYTES]);
        let tr = RankEnv::from_vars(vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            (ENV_NCCL_ID, &hex),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((tr.rank, tr.world, tr.device), (1, 2, 1));
        let err =
            |pairs: &[(&str, &str)]| format!("{:#}", RankEnv::from_vars(vars(pairs)).unwrap_err());
        assert!(err(&[(ENV_RANK, "0")]).contains(ENV_WORLD));
        assert!(err(&[(ENV_RANK, "x"), (ENV_WORLD, "2")]).contains("MEGAMOE_RANK=\"x\""));
        assert!(err(&[(ENV_RANK, "2"), (ENV_WORLD, "2")]).contains("outside a world of 2"));
        assert!(err(&[(ENV_RANK, "0"), (ENV_WORLD, "2")]).contains(ENV_NCCL_ID));
        assert!(
            err(&[(ENV_RANK, "0"), (ENV_WORLD, "2"), (ENV_NCCL_ID, "abc")]).contains("256 hex")
        );
    }

    #[test]
    fn ranks_and_gpus_are_checked_before_any_gpu_work() {
        assert!(check_ranks(1, 16).is_ok());
        assert!(check_ranks(4, 256).is_ok());
        assert!(check_ranks(0, 16).is_err());
        let e = format!("{:#}", check_ranks(3, 256).unwrap_err());
        assert!(e.contains("--ranks 3") && e.contains("split evenly"), "{e}");
        assert!(check_gpus(2, 8, None).is_ok());
        let e = format!("{:#}", check_gpus(4, 2, None).unwrap_err());
        assert!(e.contains("needs 4 GPUs") && e.contains("has 2"), "{e}");
        let e = format!(
            "{:#}",
            check_gpus(2, 0, Some("no CUDA driver")).unwrap_err()
        );
        assert!(e.contains("has none (no CUDA driver)"), "{e}");
    }

    #[test]
    fn nccl_ids_round_trip_through_hex() {
        let id: [u8; NCCL_ID_BYTES] = std::array::from_fn(|i| (255 - i) as u8);
        let h = id_to_hex(&id);
        assert_eq!(h.len(), 256);
        assert_eq!(id_from_hex(&h).unwrap(), id);
        let mut bad = h.clone();
        bad.replace_range(10..12, "zz");
        assert!(format!("{:#}", id_from_hex(&bad).unwrap_err()).contains("non-hex pair at 10"));
    }

    #[test]
    fn a_world_of_one_needs_no_nccl_and_more_ranks_say_why_it_is_missing() {
        let c = crate::dist::comm::Communicator::single();
        assert_eq!((c.rank, c.world), (0, 1));
        if !comm::nccl_loadable() {
            let e = format!("{:#}", comm::nccl_check().unwrap_err());
            assert!(
                e.contains("NCCL could not be loaded") && e.contains("libnccl.so.2"),
                "{e}"
            );
        }
    }
}
