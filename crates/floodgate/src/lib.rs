//! The parts of the `floodgate` command that are worth reaching without
//! running it: the `simulate` trace reader (for the fuzz targets in
//! `fuzz/`). Everything else lives in the binary.

pub mod trace;
