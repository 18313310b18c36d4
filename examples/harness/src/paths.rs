//! Where things are: the workspace, its release binaries, the `.venv`, run directories.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{bail, Result};

/// The workspace root.
pub fn workspace() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::canonicalize(&path).unwrap_or(path)
}

fn existing(path: PathBuf, hint: &str) -> Result<PathBuf> {
    if path.exists() {
        Ok(path)
    } else {
        bail!("{} not found ({hint})", path.display())
    }
}

/// A release binary of this workspace (`KVROUTE_BIN_DIR` overrides `target/release`).
pub fn binary(name: &str) -> Result<PathBuf> {
    let dir = std::env::var_os("KVROUTE_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/release"));
    existing(dir.join(name), "run `make build` first")
}

/// A tool from the project's venv (`KVROUTE_VENV` overrides `.venv`): `envoy`, `nats-server`.
pub fn venv_tool(name: &str) -> Result<PathBuf> {
    let venv = std::env::var_os("KVROUTE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(".venv"));
    existing(venv.join("bin").join(name), "run `make venv` first")
}

/// The Python of the venv holding NVIDIA Dynamo (`make venv-dynamo`; `KVROUTE_DYNAMO_VENV`
/// overrides `.venv-dynamo`).
pub fn dynamo_python() -> Result<PathBuf> {
    let venv = std::env::var_os("KVROUTE_DYNAMO_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(".venv-dynamo"));
    existing(venv.join("bin/python"), "run `make venv-dynamo` first")
}

/// The Python of the venv holding vLLM for CPUs (`make venv-vllm`; `KVROUTE_VLLM_VENV`
/// overrides `.venv-vllm`).
pub fn vllm_python() -> Result<PathBuf> {
    let venv = std::env::var_os("KVROUTE_VLLM_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(".venv-vllm"));
    existing(venv.join("bin/python"), "run `make venv-vllm` first")
}

/// The filter's wasm module (`KVROUTE_FILTER_WASM` overrides the release build: A/B runs).
pub fn filter_wasm() -> Result<PathBuf> {
    let path = std::env::var_os("KVROUTE_FILTER_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/wasm32-wasip1/release/kvroute_filter.wasm"));
    existing(path, "run `make build` first")
}

/// `make bench-datapath`'s reference module: the least a body-reading wasm filter costs.
pub fn wasm_floor() -> Result<PathBuf> {
    existing(
        workspace().join("target/wasm32-wasip1/release/kvroute_wasm_floor.wasm"),
        "run `make build` first",
    )
}

/// The demo model directory.
pub fn model_dir() -> PathBuf {
    workspace().join("examples/models/tiny-llama")
}

/// A fresh directory for one stack's configs and logs: `target/e2e/<name>-<pid>-<n>`.
pub fn run_dir(name: &str) -> Result<PathBuf> {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = workspace()
        .join("target/e2e")
        .join(format!("{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
