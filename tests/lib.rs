//! End-to-end tests live in `tests/`; each starts real processes through `kvroute-harness`.
//! They need the release binaries, the wasm filter and the `.venv`: run them with `make test`.
