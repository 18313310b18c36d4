//! The index on local disk (`[snapshot]`): every `interval_ms` each cache's entries and the last
//! message applied to it are written to one file (msgpack, written beside it and renamed, so a
//! crash mid-write leaves the previous one whole); at start the file is read and each cache put
//! back when its worker is in the fleet ([`crate::sidecar::Sidecar::restore`]). A sidecar with no
//! peer thus starts with what it knew, not empty. The events after a cache's message come from
//! the engine where it can replay them (vLLM's replay socket, when its buffer reaches back);
//! Dynamo on NATS keeps no history, so a restored Dynamo cache lacks what happened while the
//! sidecar was down until the worker stores and evicts again, or a clean peer's copy replaces it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use crate::config::SnapshotConfig;
use crate::core::digest::Snapshot;
use crate::sidecar::Sidecar;

/// The file's format version: a file of another version is not read.
const VERSION: u32 = 1;

/// Largest file read (23 bytes an entry as msgpack at most: 46M entries).
const MAX_FILE: u64 = 1 << 30;

/// One cache as saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedCache {
    /// The worker's address.
    pub worker: String,
    /// The rank.
    pub rank: u32,
    /// The last message applied to it.
    pub seq: u64,
    /// (engine hash, node), least recently used first.
    pub entries: Vec<(u64, u64)>,
    /// Each entry's parent ([`crate::core::digest::to_wire`]).
    #[serde(default)]
    pub parents: Vec<u64>,
}

impl SavedCache {
    /// As the core installs it.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            seq: self.seq,
            entries: crate::core::digest::from_wire(&self.entries, &self.parents),
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct File {
    version: u32,
    caches: Vec<SavedCache>,
}

/// Write `caches` to `path` (through `<path>.tmp`); the bytes written.
pub fn write(path: &Path, caches: Vec<SavedCache>) -> anyhow::Result<usize> {
    let body = rmp_serde::to_vec(&File {
        version: VERSION,
        caches,
    })?;
    let tmp = tmp_path(path);
    std::fs::write(&tmp, &body).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(body.len())
}

/// The caches saved at `path`; `None` when there is no file yet.
pub fn read(path: &Path) -> anyhow::Result<Option<Vec<SavedCache>>> {
    let size = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    anyhow::ensure!(
        size <= MAX_FILE,
        "{} is {size} bytes: too big",
        path.display()
    );
    let body = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file: File =
        rmp_serde::from_slice(&body).with_context(|| format!("decoding {}", path.display()))?;
    anyhow::ensure!(
        file.version == VERSION,
        "{} has format version {}, this sidecar reads {VERSION}",
        path.display(),
        file.version
    );
    Ok(Some(file.caches))
}

/// Read the snapshot at start and hand its caches to `state` to put back; a missing file is a
/// first start, a bad one is said and ignored (the sidecar starts empty, as without one).
pub fn restore(config: &SnapshotConfig, state: &Sidecar) {
    let caches = match read(&config.path) {
        Ok(Some(c)) => c,
        Ok(None) => {
            tracing::info!(path = %config.path.display(), "no index snapshot yet: starting empty");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "index snapshot unreadable: starting empty");
            return;
        }
    };
    let blocks: usize = caches.iter().map(|c| c.entries.len()).sum();
    tracing::info!(path = %config.path.display(), caches = caches.len(), blocks, "index snapshot read: putting its caches back");
    let saved = caches
        .iter()
        .map(|c| (c.worker.clone(), c.rank, c.snapshot()))
        .collect();
    let wait = Duration::from_millis(config.restore_wait_ms);
    state.restore(saved, wait, std::time::Instant::now());
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// Every cache of the index as it is now, as written.
fn take(state: &Sidecar) -> Vec<SavedCache> {
    state
        .saved_caches()
        .into_iter()
        .map(|(worker, rank, s)| {
            let (entries, parents) = crate::core::digest::to_wire(&s.entries);
            SavedCache {
                worker,
                rank,
                seq: s.seq,
                entries,
                parents,
            }
        })
        .collect()
}

/// Write the snapshot every interval until the process ends; a failed write is said, counted
/// and tried again at the next one.
pub async fn run(config: SnapshotConfig, state: Arc<Sidecar>) {
    let mut tick = tokio::time::interval(Duration::from_millis(config.interval_ms.max(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let caches = take(&state);
        let path = config.path.clone();
        let written = tokio::task::spawn_blocking(move || write(&path, caches)).await;
        let written = match written {
            Ok(Ok(bytes)) => Ok(bytes),
            Ok(Err(e)) => Err(format!("{}: {e:#}", config.path.display())),
            Err(e) => Err(format!("the task writing it failed: {e}")),
        };
        state.disk_snapshot_written(written);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::block_map::Tag;
    use crate::core::event::EngineHash;

    #[test]
    fn a_snapshot_reads_back_and_a_bad_file_is_an_error() {
        let dir = std::env::temp_dir().join(format!("kvroute-snap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("index.snap");
        assert_eq!(read(&path).unwrap(), None, "no file yet");
        let caches = vec![SavedCache {
            worker: "10.0.0.1:8000".into(),
            rank: 1,
            seq: 42,
            entries: vec![(1, u64::MAX), (2, 3)],
            parents: vec![
                u64::from(Tag::of(EngineHash(1)).0),
                u64::from(Tag::of(EngineHash(1)).0),
            ],
        }];
        let entries = caches[0].snapshot().entries;
        assert_eq!(entries[0].parent, None, "a root");
        assert_eq!(entries[1].parent, Some(Tag::of(EngineHash(1))));
        let bytes = write(&path, caches.clone()).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, bytes);
        assert!(!tmp_path(&path).exists());
        assert_eq!(read(&path).unwrap(), Some(caches));
        std::fs::write(&path, b"not msgpack").unwrap();
        assert!(read(&path).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
